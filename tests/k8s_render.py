"""A small `kustomize build` for the tests: renders exactly the subset of kustomize k8s/ uses.

No kustomize binary is installable from the package registries these machines reach in a form
the test suite can depend on (the npm package ships a 2022 binary through an optional
dependency; the PyPI bindings need Python >= 3.14), so tests/test_k8s.py renders the manifests
with this module and, where a real kustomize is on PATH (or named by ``KUSTOMIZE``), checks that
both give the same objects (they did, when written, for kustomize v4.5.4 and for the kustomize
library of pykustomize 0.1.4, kustomize/api v0.21.3).

Supported, and nothing more (anything else in a kustomization raises ``UnsupportedFeature``, so
k8s/ cannot silently drift past what is rendered here):

- ``resources``: YAML files (several documents each) and directories holding a kustomization;
- ``namespace``: set on every namespaced object;
- ``labels``: ``pairs`` added to every object's ``metadata.labels`` (never to selectors or pod
  templates: ``includeSelectors`` / ``includeTemplates`` are refused);
- ``images``: ``name`` with ``newName`` / ``newTag`` on the containers of workload pod templates;
- ``patches``: ``path`` only, one strategic-merge patch per file, applied to the object of the
  same kind and name. Maps merge, ``null`` deletes a key, lists listed in ``MERGE_KEYS`` merge
  element by element on their key, every other list is replaced (as Kubernetes does for
  ``args``, ``tolerations``, ``metrics``). ``$patch`` directives are refused.

Applied in kustomize's order for these fields: resources, patches, namespace, labels, images.

Usage: ``python tests/k8s_render.py k8s/overlays/gpu`` prints the rendered YAML.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

Object = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "namespace", "labels", "images", "patches"}
# Strategic-merge keys of the lists patched in k8s/ (from the Kubernetes API's patchMergeKey).
# "ports" is a container's port list; a Service's ports (merge key "port") are never patched.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
CLUSTER_SCOPED_KINDS = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "PriorityClass",
    "StorageClass",
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


class UnsupportedFeature(ValueError):
    """The kustomization uses something this subset does not render."""


def build(directory: Path) -> list[Object]:
    """The objects `kustomize build directory` would print (in input order, not kustomize's)."""
    directory = Path(directory)
    kustomization = _load_kustomization(directory)
    objects: list[Object] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects.extend(build(path))
        else:
            objects.extend(_load_documents(path))
    for patch in kustomization.get("patches", []):
        _apply_patch(objects, directory, patch)
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED_KINDS:
                obj["metadata"]["namespace"] = kustomization["namespace"]
    for entry in kustomization.get("labels", []):
        if entry.get("includeSelectors") or entry.get("includeTemplates"):
            raise UnsupportedFeature("labels: only metadata labels (no selectors or templates)")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
    for image in kustomization.get("images", []):
        _set_image(objects, image)
    return objects


def _load_kustomization(directory: Path) -> dict[str, Any]:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).exists():
            data = yaml.safe_load((directory / name).read_text()) or {}
            unsupported = set(data) - SUPPORTED_FIELDS
            if unsupported:
                raise UnsupportedFeature(f"{directory / name}: {sorted(unsupported)}")
            return dict(data)
    raise FileNotFoundError(f"no kustomization in {directory}")


def _load_documents(path: Path) -> list[Object]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _apply_patch(objects: list[Object], directory: Path, patch: dict[str, Any]) -> None:
    if set(patch) != {"path"}:
        raise UnsupportedFeature(f"patches: only {{path: FILE}}, got {sorted(patch)}")
    documents = _load_documents(directory / patch["path"])
    if len(documents) != 1:
        raise UnsupportedFeature(f"{patch['path']}: one patch per file")
    doc = documents[0]
    kind, name = doc["kind"], doc["metadata"]["name"]
    targets = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(targets) != 1:
        raise ValueError(f"{patch['path']}: {len(targets)} objects are {kind}/{name}")
    merged = strategic_merge(targets[0], doc)
    objects[objects.index(targets[0])] = merged


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """``patch`` merged into a copy of ``base`` (the subset described in the module docstring)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if any(key.startswith("$") for key in patch):
            raise UnsupportedFeature(f"{field}: $-directives")
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if isinstance(patch, list) and isinstance(base, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        if not all(isinstance(e, dict) and key in e for e in base + patch):
            raise UnsupportedFeature(f"{field}: elements without merge key {key!r}")
        merged_list = copy.deepcopy(base)
        for element in patch:
            index = next((i for i, e in enumerate(merged_list) if e[key] == element[key]), None)
            if index is None:
                merged_list.append(copy.deepcopy(element))
            else:
                merged_list[index] = strategic_merge(merged_list[index], element)
        return merged_list
    return copy.deepcopy(patch)


def _set_image(objects: list[Object], image: dict[str, str]) -> None:
    unsupported = set(image) - {"name", "newName", "newTag"}
    if unsupported:
        raise UnsupportedFeature(f"images: {sorted(unsupported)}")
    for obj in objects:
        if obj["kind"] not in WORKLOAD_KINDS:
            continue
        pod = obj["spec"]["template"]["spec"]
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            name, tag = _split_image(container["image"])
            if name == image["name"]:
                new_tag = image.get("newTag", tag)
                new_name = image.get("newName", name)
                container["image"] = f"{new_name}:{new_tag}" if new_tag else new_name


def _split_image(reference: str) -> tuple[str, str | None]:
    """``registry:5000/pdserve:1.0`` -> (``registry:5000/pdserve``, ``1.0``); digests refused."""
    if "@" in reference:
        raise UnsupportedFeature(f"image digests: {reference}")
    name, _, tag = reference.rpartition(":")
    if not name or "/" in tag:  # no tag (a colon there belongs to a registry port)
        return reference, None
    return name, tag


def main(argv: list[str]) -> int:
    for directory in argv or ["k8s/base"]:
        print(yaml.safe_dump_all(build(Path(directory)), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
