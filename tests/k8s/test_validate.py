"""Every object of every overlay against its schema, offline: core objects with kubernetes-validate
(strict: an unknown field is an error, as `kubectl apply` makes it) for Kubernetes 1.28 and the newest
version it knows; KEDA and Prometheus objects against their CRDs' schemas (k8s/schemas/), closed the
same way."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.k8s.conftest import K8S, OVERLAYS, Manifest

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1_scaledobject.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_v1_servicemonitor.json",
}


def closed(schema: Any) -> Any:
    """The schema with unknown fields refused wherever the CRD lists the fields (the API server
    with field validation Strict, kubectl's default, rejects them there)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    open_ = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_:
        out["additionalProperties"] = False
    return out


def crd_validator(api_version: str, kind: str) -> Any:
    schema = closed(json.loads((K8S / "schemas" / CRD_SCHEMAS[(api_version, kind)]).read_text()))
    schema["properties"]["metadata"] = {"type": "object"}  # checked by the API server, not the CRD
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("version", ["1.28.0", "latest"])
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_objects_are_valid_kubernetes(
    rendered: dict[str, list[Manifest]], overlay: str, version: str
) -> None:
    version = kubernetes_validate.latest_version() if version == "latest" else version
    core = [o for o in rendered[overlay] if (o["apiVersion"], o["kind"]) not in CRD_SCHEMAS]
    for manifest in core:
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{manifest['kind']}/{manifest['metadata']['name']} for {version}: {exc.message}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_objects_match_their_crds(rendered: dict[str, list[Manifest]], overlay: str) -> None:
    custom = [o for o in rendered[overlay] if (o["apiVersion"], o["kind"]) in CRD_SCHEMAS]
    assert {o["kind"] for o in custom} >= {"ServiceMonitor"}
    for manifest in custom:
        errors = [
            e.message for e in crd_validator(manifest["apiVersion"], manifest["kind"]).iter_errors(manifest)
        ]
        assert not errors, f"{manifest['kind']}/{manifest['metadata']['name']}: {errors}"


def test_the_crd_check_refuses_a_misspelt_field() -> None:
    validator = crd_validator("keda.sh/v1alpha1", "ScaledObject")
    good = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "x"},
        "spec": {"scaleTargetRef": {"name": "x"}, "triggers": [{"type": "prometheus", "metadata": {}}]},
    }
    assert validator.is_valid(good)
    assert not validator.is_valid({**good, "spec": {**good["spec"], "minReplicas": 0}})  # HPA's spelling
    assert not validator.is_valid({**good, "spec": {"scaleTargetRef": {"name": "x"}}})  # no triggers
