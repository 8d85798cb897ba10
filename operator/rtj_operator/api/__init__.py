"""The ResilientTrainingJob API: identity constants, pydantic models and the CRD generator.

The pydantic models in `rtj_operator.api.models` are the single source of truth for the API:
`rtj_operator.api.crd` derives the CustomResourceDefinition from them (`make crds`), and the
operator parses every object it reads with them (`models.parse_job`).
"""

GROUP = "training.resilient.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ResilientTrainingJob"
PLURAL = "resilienttrainingjobs"
SINGULAR = "resilienttrainingjob"
SHORT_NAMES = ("rtj",)
CATEGORIES = ("training",)
