"""Next-token prediction: pre-training on text (`data.format = "text"`) and supervised fine-tuning
on conversations (`"chat"`, the loss on what `data.loss_on` marks)."""
