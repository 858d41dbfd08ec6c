"""Container image references, parsed as a registry reads them, and the admin's image allowlist.

Why parsed and not compared as strings: `gcr.io/allowed` is a string prefix of
`gcr.io/allowed.evil.com/x`, and `ghcr.io/lora-operator/lora-trainer` of
`ghcr.io/lora-operator/lora-trainer-evil`. A reference is split into registry, repository, tag
and digest by the grammar of the distribution project (github.com/distribution/reference), which
containerd and the kubelet follow; an allowlist entry names a registry and a repository (or a
repository path ending in `/`, for every repository under it), optionally pinned to one digest.
Pure functions; nothing here talks to a registry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
#: A well-formed image reference, `[REGISTRY[:PORT]/]PATH[:TAG][@DIGEST]` (RE2-compatible: the CRD
#: schema carries it, so the API server refuses a malformed `spec.image` before the operator sees it).
IMAGE_PATTERN = rf"^{_NAME}(?::{_TAG})?(?:@{_DIGEST})?$"
#: Longest image reference accepted (the repository name alone is limited to 255 characters).
MAX_IMAGE = 512
DOCKER_HUB = "docker.io"
_DOCKER_HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io"}


class BadImage(ValueError):
    """Not a well-formed image reference (or allowlist entry); the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class ImageRef:
    """A parsed reference: `registry` lower-cased, Docker Hub's short names expanded."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None


def _split_registry(name: str) -> tuple[str, str]:
    """(registry, repository) as the distribution project splits a name: the first component is a
    registry when it has a `.` or a `:` or is `localhost`; otherwise the image is on Docker Hub
    (`library/` for one-component names)."""
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry = first.lower()
        return (DOCKER_HUB if registry in _DOCKER_HUB_ALIASES else registry), rest
    return DOCKER_HUB, (name if rest else f"library/{name}")


def parse_image(reference: str) -> ImageRef:
    """`reference` as an ImageRef; BadImage when it is not a well-formed image reference."""
    if len(reference) > MAX_IMAGE or not re.fullmatch(IMAGE_PATTERN, reference):
        raise BadImage(
            f"{reference!r} is not a well-formed image reference; write REGISTRY/REPOSITORY:TAG or "
            "REGISTRY/REPOSITORY@sha256:DIGEST (lower-case repository, e.g. ghcr.io/lora-operator/lora-trainer:0.1.0)"
        )
    rest, _, digest = reference.partition("@")
    name, tag = rest, None
    if ":" in rest.rsplit("/", 1)[-1]:
        name, _, tag = rest.rpartition(":")
    registry, repository = _split_registry(name)
    if registry == DOCKER_HUB and "/" not in repository:
        repository = f"library/{repository}"
    return ImageRef(registry, repository, tag, digest or None)


@dataclass(frozen=True, slots=True)
class ImageRule:
    """One allowlist entry: a repository, every repository under a path (`subtree`), or one digest."""

    registry: str
    repository: str
    subtree: bool = False
    digest: str | None = None

    @classmethod
    def parse(cls, entry: str) -> ImageRule:
        """`REGISTRY/REPOSITORY`, `REGISTRY/PATH/` (every repository under PATH; `REGISTRY/` for the
        whole registry) or `REGISTRY/REPOSITORY@sha256:DIGEST`; a tag is refused (tags move, so they
        pin nothing)."""
        subtree = entry.endswith("/")
        body = entry.rstrip("/")
        if subtree and "/" not in body and ("." in body or ":" in body or body == "localhost"):
            registry, _ = _split_registry(f"{body}/x")  # `REGISTRY/`: every repository of a registry
            return cls(registry, "", subtree=True)
        ref = parse_image(body)
        if ref.tag is not None:
            raise BadImage(f"{entry!r} names a tag; tags can be moved to other images, so name the repository "
                           "(REGISTRY/REPOSITORY), a path (REGISTRY/PATH/) or a digest (REGISTRY/REPOSITORY@sha256:...)")
        if subtree and ref.digest:
            raise BadImage(f"{entry!r}: a digest pins one repository's image, not a path; drop the trailing '/'")
        if "/" not in body:
            raise BadImage(f"{entry!r} names no registry; write REGISTRY/REPOSITORY (e.g. ghcr.io/lora-operator/lora-trainer)")
        return cls(ref.registry, ref.repository, subtree, ref.digest)

    def allows(self, image: ImageRef) -> bool:
        """Same registry, and the same repository (or one under the path, segment by segment), and
        the pinned digest if there is one."""
        if image.registry != self.registry:
            return False
        if self.subtree:
            inside = not self.repository or image.repository.startswith(self.repository + "/")
        else:
            inside = image.repository == self.repository
        return inside and (self.digest is None or image.digest == self.digest)


def image_allowed(image: str, rules: list[ImageRule], *, require_digest: bool = False) -> str | None:
    """None when `image` is allowed; otherwise why not, in words (malformed, no digest, not listed)."""
    try:
        ref = parse_image(image)
    except BadImage as e:
        return str(e)
    if require_digest and ref.digest is None:
        return f"{image!r} has no digest and the operator requires images pinned by digest; write {image}@sha256:DIGEST"
    if not any(rule.allows(ref) for rule in rules):
        return f"{image!r} (registry {ref.registry}, repository {ref.repository}) is not in the operator's allowedImages"
    return None
