"""Run by the engine tier in vLLM's own environment (.venv-vllm, `tests/vllm_engine.py`): vLLM's offline
engine loads each model folder of a job in turn and writes the prompt log-probs of the job's token ids
(the log-prob of each token given those before it), or the engine's own error where it cannot run the
model. Usage: python prompt_logprobs.py JOB.json OUT.json, JOB: [{"folder": ..., "prompts": [[ids]],
"engine": {LLM keyword arguments}}]."""

import gc
import json
import sys
import traceback


def prompt_logprobs(job: dict) -> dict:
    """The job's results, or the engine's error (its root cause is in this process's log, which the tests
    read: the engine core and its workers log it)."""
    from vllm import LLM, SamplingParams

    llm = None
    try:
        llm = LLM(model=job["folder"], dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0,
                  kv_cache_memory_bytes=256 << 20, **job.get("engine", {}))
        prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0))
        return {"logprobs": [[entry[ids[i + 1]].logprob for i, entry in enumerate(out.prompt_logprobs[1:])]
                             for ids, out in zip(job["prompts"], outputs)]}
    except Exception as err:  # the engine refused or failed the model
        return {"error": "".join(traceback.format_exception_only(err)).strip()}
    finally:
        del llm
        gc.collect()


def main() -> None:
    jobs = json.loads(open(sys.argv[1]).read())
    results = [prompt_logprobs(job) for job in jobs]
    with open(sys.argv[2], "w") as out:
        json.dump(results, out)


if __name__ == "__main__":
    main()
