"""The `[model]` section of a training config: a `ModelShape` whose options are its family's.

`ModelConfig` adds to the shape what only the registry (`mop.models.families`) knows: it turns
`options` (a table read from a config file or a checkpoint's record, its family's dataclass, or
nothing) into the family's `Options` when it is made, and checks the family's name and options in
`validate`. The families and the shared layers below the registry read the shape alone.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from mop.models.families import FAMILIES, family_options, unknown_family
from mop.models.shape import ModelShape, wrong_types


@dataclass(frozen=True)
class ModelConfig(ModelShape):
    @classmethod
    def of(cls, shape: ModelShape) -> ModelConfig:
        """The config of a shape (a family's `config_from_hf`, whose options it built)."""
        return cls(**{f.name: getattr(shape, f.name) for f in fields(shape)})

    def __post_init__(self):
        object.__setattr__(self, "options", family_options(self.family, self.options))

    def validate(self) -> list[tuple[str, str]]:
        """Problems as (key, message) pairs; empty when the model is buildable."""
        problems = wrong_types(self)
        if problems:
            return problems
        if self.family not in FAMILIES:
            return [("family", unknown_family(self.family))]
        return self._options_problems(FAMILIES[self.family].options) or super().validate()

    def _options_problems(self, kind: type | None) -> list[tuple[str, str]]:
        """The family's options: of its dataclass, of their types, valid by its own rules."""
        if kind is None:
            return [] if self.options is None else [
                ("options", f"model.family={self.family!r} takes no options; remove [model.options]")]
        if not isinstance(self.options, kind):
            return [("options", f"{self.options!r} are not options of model.family={self.family!r}; its keys are "
                                f"{', '.join(f.name for f in fields(kind))}")]
        own = self.options.validate(self) if hasattr(self.options, "validate") else []
        problems = wrong_types(self.options) + own
        return [(f"options.{key}", message) for key, message in problems]
