"""`python -m rtj_operator`: run the operator.

Settings come from the environment (`rtj_operator.config`, variables `RTJ_OPERATOR_*`). The
operator watches every namespace, or only `RTJ_OPERATOR_NAMESPACE`. It runs standalone (one
replica, Deployment strategy Recreate) unless `RTJ_OPERATOR_PEERING=true`, where kopf peering
keeps one replica active and the others paused (docs/operator.md, "High availability").
"""

from __future__ import annotations

import logging
import sys

import kopf

from rtj_operator.config import ConfigurationError, settings_from_environment


def main() -> int:
    try:
        settings = settings_from_environment()
    except ConfigurationError as error:
        print(f"rtj-operator: configuration error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s [%(name)s] %(message)s"
    )
    # Importing the module registers the handlers with kopf's default registry.
    from rtj_operator import handlers  # noqa: F401

    kopf.run(
        standalone=not settings.peering,
        clusterwide=not settings.namespace,
        namespaces=[settings.namespace] if settings.namespace else (),
        liveness_endpoint=settings.liveness_endpoint(),
        memo=kopf.Memo(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
