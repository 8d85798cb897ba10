"""`spec.env`: the trainer's own environment variables, literal or from a Secret, ConfigMap or the
pod's fields. Names with the operator's prefix (`RTJ_`) are refused: the operator sets those
(`rtj_operator.trainerenv`).
"""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import ConfigDict, Field, model_validator

from rtj_operator.api.schema import ApiModel
from rtj_operator.api.spec_fields import RESERVED_ENV_PREFIX, cel, validations


class KeySelector(ApiModel):
    """Selects a key of a Secret or ConfigMap in the job's namespace."""

    name: Annotated[str, Field(description="Name of the Secret or ConfigMap.", max_length=253)]
    key: Annotated[str, Field(description="The key to select.", max_length=253)]
    optional: bool | None = Field(
        default=None, description="Whether the Secret or ConfigMap (or its key) may be missing."
    )


class FieldSelector(ApiModel):
    """Selects a field of the pod (downward API)."""

    field_path: str = Field(
        description="Path of the field, for example `metadata.name` or `status.hostIP`.",
        max_length=256,
    )
    api_version: str | None = Field(
        default=None,
        description="API version the fieldPath is written in (default `v1`).",
        max_length=64,
    )


class EnvVarSource(ApiModel):
    """Source of an environment variable's value: exactly one of the selectors."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef)]"
                ".filter(x, x).size() == 1",
                "valueFrom must set exactly one of secretKeyRef, configMapKeyRef, fieldRef",
            )
        )
    )

    secret_key_ref: KeySelector | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: KeySelector | None = Field(
        default=None, description="A key of a ConfigMap."
    )
    field_ref: FieldSelector | None = Field(default=None, description="A field of the pod.")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        chosen = [self.secret_key_ref, self.config_map_key_ref, self.field_ref]
        if sum(x is not None for x in chosen) != 1:
            raise ValueError(
                "valueFrom must set exactly one of secretKeyRef, configMapKeyRef, fieldRef"
            )
        return self


class EnvVar(ApiModel):
    """An environment variable of the trainer container: a literal value or a reference."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!(has(self.value) && has(self.valueFrom))",
                "env: value and valueFrom are mutually exclusive",
                field_path=".valueFrom",
            ),
            cel(
                f"!self.name.startsWith('{RESERVED_ENV_PREFIX}')",
                f"env name: the prefix {RESERVED_ENV_PREFIX} is reserved for the operator",
                field_path=".name",
            ),
        )
    )

    name: str = Field(
        description=(
            "Name of the variable. Names starting with `RTJ_` are reserved: the operator sets "
            "them (see docs/design.md). `TRAINER_FAULTS` is passed to the trainer's fault "
            "injector."
        ),
        min_length=1,
        max_length=256,
        pattern=r"^[^=]+$",
    )
    value: str | None = Field(default=None, description="Literal value.", max_length=32768)
    value_from: EnvVarSource | None = Field(
        default=None, description="Take the value from a Secret, a ConfigMap or the pod."
    )

    @model_validator(mode="after")
    def _value_xor_value_from(self) -> Self:
        if self.value is not None and self.value_from is not None:
            raise ValueError("env: value and valueFrom are mutually exclusive")
        if self.name.startswith(RESERVED_ENV_PREFIX):
            raise ValueError(
                f"env name: the prefix {RESERVED_ENV_PREFIX} is reserved for the operator"
            )
        return self
