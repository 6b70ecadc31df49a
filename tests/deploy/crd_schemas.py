"""Offline, strict schemas for Kubeflow Trainer v2 (TrainJob, ClusterTrainingRuntime) and the
JobSet v1alpha2 spec inside a runtime.

Source: `kubeflow-trainer-api` (PyPI, in the dev extra), Kubeflow's Python models generated
from Trainer's OpenAPI spec; they embed JobSet's v1alpha2 types, which is what a runtime's
`template.spec` is. The models' JSON schema is made strict (an unknown field anywhere is an
error, as kubernetes-validate's strict mode does for core kinds). Two Kubernetes types whose
generated models do not describe their JSON form are replaced by what the API accepts:
a resource Quantity (a string or a number) and IntOrString.

The core parts inside (the Job template) are validated separately with kubernetes-validate,
per Kubernetes release; enums that only the CRD's kubebuilder markers know (failure policy
actions) are checked by the tests themselves.
"""

from __future__ import annotations

import functools
from importlib.metadata import version
from typing import Any

import jsonschema
import pytest

trainer_api = pytest.importorskip(
    "kubeflow_trainer_api.models",
    reason="pip install -e '.[dev]' (kubeflow-trainer-api has the Trainer v2 and JobSet API models)",
)

GROUP_VERSION = "trainer.kubeflow.org/v1alpha1"
MODELS = {
    "TrainJob": "TrainerV1alpha1TrainJob",
    "ClusterTrainingRuntime": "TrainerV1alpha1ClusterTrainingRuntime",
}
AS_SENT = {
    "IoK8sApimachineryPkgApiResourceQuantity": {"type": ["string", "number"]},
    "IoK8sApimachineryPkgUtilIntstrIntOrString": {"type": ["string", "integer"]},
}


def _strict(node: Any) -> None:
    if isinstance(node, dict):
        if "properties" in node and node.get("type") == "object":
            node.setdefault("additionalProperties", False)
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)


@functools.cache
def strict_schema(kind: str) -> dict[str, Any]:
    model = getattr(trainer_api, MODELS[kind])
    schema = model.model_json_schema(by_alias=True)
    defs = schema.get("$defs", {})
    for name, replacement in AS_SENT.items():
        if name in defs:
            defs[name] = dict(replacement)
    _strict(schema)
    return schema


def validate_crd(doc: dict[str, Any]) -> None:
    """Raise AssertionError naming the first field the Trainer/JobSet API does not accept."""
    kind = doc.get("kind")
    assert kind in MODELS, f"no Trainer v2 schema for kind {kind!r}"
    assert doc.get("apiVersion") == GROUP_VERSION, f"{kind}: apiVersion {doc.get('apiVersion')!r}, not {GROUP_VERSION}"
    validator = jsonschema.Draft202012Validator(strict_schema(kind))
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        raise AssertionError(f"{kind} {doc['metadata'].get('name')}: {where}: {error.message} "
                             f"(kubeflow-trainer-api {version('kubeflow-trainer-api')})")
