"""A small kustomize renderer, enough for deploy/k8s/ (kubectl is not part of the test set-up).

Supports the kustomization fields deploy/k8s uses and refuses any other, so a manifest tree that
starts using one fails loudly here instead of being rendered wrong:
  resources   files (multi-document YAML) and directories holding a kustomization.yaml
  patches     `- path: FILE`: strategic merge patches, each aimed by its kind and metadata.name;
              `$patch: delete` on the document removes the object, on an item of a merged list
              (a container, a volume) removes that item
  namespace   set on every namespaced object
  images      `name` -> `newName` / `newTag`
  replicas    `name` -> `count` on a Deployment or StatefulSet
Strategic merge as the API server does it for the lists deploy/k8s patches: containers, volumes
and env merge by `name`, volumeMounts by `mountPath`; any other list is replaced; a null deletes.
Lists keep the base's order (kustomize may put patched items first: tests compare by key).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

FIELDS = {"apiVersion", "kind", "namespace", "resources", "patches", "images", "replicas"}
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding",
                  "IngressClass", "PriorityClass", "CustomResourceDefinition"}


def load_documents(path: Path) -> list[dict]:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def render(directory: Path) -> list[dict]:
    """The objects `kustomize build directory` would print (order aside). ValueError on what it cannot do."""
    kustomization = load_documents(directory / "kustomization.yaml")[0]
    unknown = set(kustomization) - FIELDS
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml: fields this renderer does not support: {sorted(unknown)}")
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        objects += render(path) if path.is_dir() else load_documents(path)
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{directory}: only `patches: - path: FILE` is supported, got {patch}")
        for document in load_documents(directory / patch["path"]):
            _apply_patch(objects, document, f"{directory}/{patch['path']}")
    for image in kustomization.get("images", []):
        _set_image(objects, image)
    for replicas in kustomization.get("replicas", []):
        _set_replicas(objects, replicas["name"], replicas["count"])
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kustomization["namespace"]
    _check_unique(objects, directory)
    return objects


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """`patch` merged into a copy of `base` (see the module's docstring)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        out = copy.deepcopy(base)
        index = {item[key]: i for i, item in enumerate(out)}
        deleted = set()
        for item in patch:
            if item.get("$patch") == "delete":
                if item[key] not in index:
                    raise ValueError(f"$patch: delete of {field} {item[key]}, which the base lacks")
                deleted.add(item[key])
            elif item[key] in index:
                out[index[item[key]]] = strategic_merge(out[index[item[key]]], item)
            else:
                out.append(copy.deepcopy(item))
        return [item for item in out if item[key] not in deleted]
    return copy.deepcopy(patch)


def _apply_patch(objects: list[dict], patch: dict, where: str) -> None:
    for i, obj in enumerate(objects):
        if obj["kind"] == patch["kind"] and obj["metadata"]["name"] == patch["metadata"]["name"]:
            if obj["apiVersion"] != patch["apiVersion"]:
                raise ValueError(f"{where}: apiVersion {patch['apiVersion']} != {obj['apiVersion']}")
            if patch.get("$patch") == "delete":
                del objects[i]
            else:
                objects[i] = strategic_merge(obj, patch)
            return
    raise ValueError(f"{where}: no {patch['kind']} {patch['metadata']['name']} to patch")


def pod_spec(obj: dict) -> dict | None:
    """The pod spec of a workload (Deployment, StatefulSet, DaemonSet, Job), else None."""
    template = obj.get("spec", {}).get("template")
    return template.get("spec") if isinstance(template, dict) else None


def _set_image(objects: list[dict], image: dict) -> None:
    found = False
    for obj in objects:
        spec = pod_spec(obj) or {}
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"
                found = True
    if not found:
        raise ValueError(f"images: no container uses {image['name']}")


def _set_replicas(objects: list[dict], name: str, count: int) -> None:
    targets = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet") and o["metadata"]["name"] == name]
    if not targets:
        raise ValueError(f"replicas: no Deployment or StatefulSet {name}")
    for obj in targets:
        obj["spec"]["replicas"] = count


def _check_unique(objects: list[dict], directory: Path) -> None:
    seen: set[tuple[str, str]] = set()
    for obj in objects:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in seen:
            raise ValueError(f"{directory}: {key[0]} {key[1]} is defined twice")
        seen.add(key)
