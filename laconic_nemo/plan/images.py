"""The container images a launch runs in (``containers/``), which recipe runs in which, and what each carries.

One image per actor, and for the megatron-core actor one per rollout engine, because vLLM wheels pin their own torch:

* ``nemo`` (frozen): ``containers/Dockerfile`` on ``nvcr.io/nvidia/nemo:25.02.01``, the NeMo-Aligner actor
  (``model.source: nemo``). NeMo-Aligner 0.7.0 is its last release; its container stays where it was tested.
* ``mcore`` (current): ``containers/Dockerfile.mcore`` on the NGC PyTorch container, TransformerEngine from the
  base, the current megatron-core: the megatron-core actor (``model.source: hf`` or ``synthetic``) with the
  project's decode engine (``rollout.engine: megatron``).
* ``vllm`` (current): ``containers/Dockerfile.vllm`` on vLLM's release image (its torch), the same megatron-core:
  the megatron-core actor with ``rollout.engine: vllm``. vLLM 0.33.0 requires ``torch==2.14.0`` (its wheel's
  METADATA), which the NGC container's source build of torch (``2.10.0a0+b4e4ee81d3`` in 25.12) does not satisfy
  (a pre-release of another version), so installing vLLM there would replace the container's torch under
  TransformerEngine: vLLM gets its own image (:func:`vllm_fits`).
* ``vllm-0.10`` (frozen): ``containers/Dockerfile.vllm-0.10``, the earlier vLLM image (vLLM 0.10.1.1,
  megatron-core 0.11.0), where the hand-written weight refit of :mod:`laconic_nemo.rollout.vllm` runs; chosen
  only by name (``plan --image vllm-0.10``).

Every version below is read from a source, named in ``sources``; a version no source read here states is None
(the image's own), and the build records what it found (``/opt/container-pins.txt``) and runs
:func:`check_installed` so that the table and the image cannot disagree on what the table states.

``plan`` (:mod:`laconic_nemo.plan.cli`) names the image a recipe runs in (:func:`image_for`) and the attention
kernel that image runs (:func:`attention_line`), not the planning machine's; the launch wrappers
(``launch/wrappers.py``) write the image's squash file as their default ``CONTAINER``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

BASE_OWN = "(the base image's own)"  # a version no source read here states


@dataclass(frozen=True)
class Image:
    """One image of ``containers/``: where it comes from and the versions it serves.

    torch / transformer_engine / megatron_core / vllm: versions of the image (None: not stated by a source read
    here, the base's own); varlen: whether that torch has ``torch.nn.attention.varlen.varlen_attn`` in a form
    :mod:`laconic_nemo.runtime.kernels` calls (None: not known before the image is built; the job reads it)."""

    name: str
    dockerfile: str
    tag: str                       # docker build -t
    base: str                      # the Dockerfile's FROM / BASE_IMAGE
    actor: str                     # "nemo_aligner" or "megatron_core"
    engines: tuple[str, ...]       # rollout.engine values it runs
    frozen: bool
    python: str | None
    torch: str | None
    transformer_engine: bool
    megatron_core: str | None
    vllm: str | None = None
    varlen: bool | None = None
    pins: dict = field(default_factory=dict)   # what the Dockerfile installs itself: package -> version
    sources: str = ""

    @property
    def squash(self) -> str:
        """The enroot squash file the launch scripts use by default (``CONTAINER``)."""
        return f"/lustre/containers/{self.tag.replace(':', '-')}.sqsh"

    def describe(self) -> str:
        parts = [f"torch {self.torch or BASE_OWN}",
                 "TransformerEngine" if self.transformer_engine else "no TransformerEngine",
                 f"megatron-core {self.megatron_core}"]
        if self.vllm:
            parts.append(f"vLLM {self.vllm}")
        state = "frozen" if self.frozen else "current"
        return f"{self.name}: {self.tag} ({self.dockerfile}, {state}; {self.base}; {', '.join(parts)})"


IMAGES: dict[str, Image] = {image.name: image for image in (
    Image(
        name="nemo", dockerfile="containers/Dockerfile", tag="laconic-nemo:25.02",
        base="nvcr.io/nvidia/nemo:25.02.01", actor="nemo_aligner", engines=("megatron", "nemo"), frozen=True,
        python=None, torch=None, transformer_engine=True, megatron_core="0.11",
        pins={"nemo-aligner": "0.7.0", "math-verify": "0.9.0"},
        sources="NeMo Framework changelog 25.02.01 = NeMo 2.2.1 (tests/test_launch.py NEMO_IN_CONTAINER); "
                "megatron-core 0.11: actors/nemo_aligner.TARGET_VERSIONS; TransformerEngine: NeMo's Qwen2 "
                "converter keeps mcore_gpt and transformer_engine together and the NeMo actor needs it "
                "(containers/Dockerfile); torch and Python: the base's own, recorded at build time"),
    Image(
        name="mcore", dockerfile="containers/Dockerfile.mcore", tag="laconic-mcore:25.12",
        base="nvcr.io/nvidia/pytorch:25.12-py3", actor="megatron_core", engines=("megatron",), frozen=False,
        python="3.12", torch="2.10.0a0+b4e4ee81d3", transformer_engine=True, megatron_core="0.19.2",
        pins={"megatron-core": "0.19.2", "transformers": "5.24.0", "omegaconf": "2.4.0", "math-verify": "0.9.0"},
        sources="NGC PyTorch release notes 25.12 (docs.nvidia.com/deeplearning/frameworks/pytorch-release-notes/"
                "rel-25-12.html): 'based on 2.10.0a0+b4e4ee81d3', CUDA 13.1.0, /usr/local/lib/python3.12; "
                "TransformerEngine preinstalled in the NGC PyTorch container from 22.09 on (TransformerEngine "
                "installation guide); megatron-core 0.19.2: PyPI's cp312 wheel (Requires-Python >= 3.12, "
                "Requires-Dist torch>=2.6.0, numpy, packaging>=24.2)"),
    Image(
        name="vllm", dockerfile="containers/Dockerfile.vllm", tag="laconic-vllm:0.33.0",
        base="vllm/vllm-openai:v0.33.0", actor="megatron_core", engines=("vllm",), frozen=False,
        python="3.12", torch="2.14.0", transformer_engine=False, megatron_core="0.19.2", vllm="0.33.0",
        varlen=True, pins={"megatron-core": "0.19.2", "omegaconf": "2.4.0", "math-verify": "0.9.0"},
        sources="vllm-0.33.0 wheel METADATA: Requires-Dist torch==2.14.0, transformers<5.21.0,>=5.16.1, "
                "Requires-Python <3.15,>=3.11, no transformer-engine (the build checks the image has none); "
                "varlen_attn: torch 2.14.0's torch/nn/attention/varlen.py:205-221 (tests/test_images.py); "
                "Python 3.12: megatron-core 0.19.2 needs >= 3.12, the build checks it"),
    Image(
        name="vllm-0.10", dockerfile="containers/Dockerfile.vllm-0.10", tag="laconic-vllm:0.10.1.1",
        base="vllm/vllm-openai:v0.10.1.1", actor="megatron_core", engines=("vllm",), frozen=True,
        python=None, torch="2.7.1", transformer_engine=False, megatron_core="0.11.0", vllm="0.10.1.1",
        varlen=False, pins={"megatron-core": "0.11.0", "math-verify": "0.9.0"},
        sources="vllm-0.10.1.1 wheel METADATA: Requires-Dist torch==2.7.1; torch.nn.attention.varlen is "
                "torch >= 2.10 (laconic_nemo/runtime/kernels.py)"),
)}


def actor_of(source: str) -> str:
    """The actor a recipe's ``model.source`` trains with: ``nemo`` -> the NeMo-Aligner actor, else megatron-core."""
    return "nemo_aligner" if source == "nemo" else "megatron_core"


def recipe_image(cfg) -> Image:
    """The image a recipe (a loaded Config) runs in by default: :func:`image_for` its actor and rollout engine."""
    return image_for(actor_of(cfg.model.source), cfg.rollout.engine)


def image_for(actor: str, engine: str) -> Image:
    """The current image that runs ``actor`` (``nemo_aligner`` / ``megatron_core``) with rollout ``engine``: the
    first of :data:`IMAGES` serving both that is not frozen, else the frozen one (the NeMo-Aligner actor)."""
    fits = [i for i in IMAGES.values() if i.actor == actor and engine in i.engines]
    if not fits:
        raise ValueError(f"no image in containers/ runs actor {actor!r} with rollout.engine = {engine!r}")
    return next((i for i in fits if not i.frozen), fits[0])


def resolve_image(name: str, actor: str, engine: str) -> Image | None:
    """``name`` (``plan --image``): ``auto`` -> :func:`image_for`; ``none`` -> None (this environment, as
    ``CONTAINER=none`` runs); else that image, which must run ``actor`` with ``engine``."""
    if name == "auto":
        return image_for(actor, engine)
    if name == "none":
        return None
    if name not in IMAGES:
        raise ValueError(f"--image = {name!r}: one of auto, none, {', '.join(IMAGES)}")
    image = IMAGES[name]
    if image.actor != actor or engine not in image.engines:
        raise ValueError(f"--image = {name!r} runs the {image.actor} actor with rollout.engine in "
                         f"{list(image.engines)}, not {actor} with {engine}")
    return image


def vllm_fits(torch_version: str, vllm_torch_requirement: str) -> bool:
    """Whether an image's installed torch satisfies vLLM's torch requirement (a PEP 440 specifier, e.g.
    ``==2.14.0``), so that vLLM installs beside it without replacing it."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return SpecifierSet(vllm_torch_requirement).contains(Version(torch_version), prereleases=True)


# ---------------------------------------------------------------------------------------------- attention
def _half(dtype: str) -> bool:
    return dtype in ("bf16", "fp16")


def packed_kernel(image: Image, attention: str, precision: str) -> str:
    """The core attention a packed micro-batch of the megatron-core actor runs in ``image`` on an sm80+ GPU, for
    ``model.attention = attention`` and ``model.precision = precision`` (the choice of
    :mod:`laconic_nemo.runtime.kernels`: ``te`` where TransformerEngine imports, else ``sdpa`` with torch's
    ``varlen_attn`` for bf16 / fp16 where torch has it, else ``flex``)."""
    from laconic_nemo.runtime.kernels import ATTENTION_CHOICES

    if attention not in ATTENTION_CHOICES:
        return f"none: model.attention must be one of {', '.join(ATTENTION_CHOICES)}"
    kind = ("te" if image.transformer_engine else "sdpa") if attention == "auto" else attention
    if kind == "te" and not image.transformer_engine:
        return f"none: model.attention=te needs TransformerEngine, which {image.tag} does not carry; use sdpa"
    if kind == "te":
        return f"te: TransformerEngine's THD attention of {image.tag} (cu_seqlens read on the device)"
    if kind == "local":
        return "local: megatron's DotProductAttention under a block-diagonal [S, S] mask"
    flex = "flex: flex_attention with a BlockMask from the row boundaries, compiled once per padded size"
    if not _half(precision):
        return f"{flex} ({precision} weights; torch {image.torch})"
    if image.varlen:
        return f"varlen: torch.nn.attention.varlen.varlen_attn of torch {image.torch}"
    if image.varlen is None:
        return (f"varlen where torch {image.torch or BASE_OWN} has torch.nn.attention.varlen."
                f"varlen_attn (read from its signature when the job starts), else {flex}")
    return f"{flex} (no varlen_attn in torch {image.torch})"


def nemo_kernel(image: Image) -> str:
    """The core attention of the NeMo-Aligner actor in ``image``: NeMo builds the TransformerEngine layer spec when
    the model config has ``transformer_engine`` (nemo-toolkit 2.2.1 ``megatron_gpt_model.py:487-494``,
    ``get_specs`` ``:154-158``), which NeMo's Qwen2 converter sets with ``mcore_gpt`` (it asserts the two agree)."""
    if image.transformer_engine:
        return (f"te: TransformerEngine's fused attention of {image.tag} on padded micro-batches (NeMo's "
                "TransformerEngine layer spec)")
    return "local: megatron's DotProductAttention on padded micro-batches"


def attention_line(image: Image, actor: str, attention: str, precision: str, packed: bool) -> str:
    """What ``plan`` prints for the attention of a launch in ``image``."""
    if actor == "nemo_aligner":
        return nemo_kernel(image)
    kernel = packed_kernel(image, attention, precision)
    return kernel if packed else f"{kernel.split(':')[0]} (padded micro-batches, grpo.micro_batch_tokens = 0)"


# ------------------------------------------------------------------------------------ the build-time check
def installed_versions() -> dict[str, str | bool | None]:
    """What this environment carries of what :class:`Image` states (run inside an image by its Dockerfile)."""
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    import sys

    import torch

    from laconic_nemo.runtime.kernels import torch_varlen_attn, transformer_engine_available, varlen_form

    return {
        "python": "%d.%d" % sys.version_info[:2], "torch": torch.__version__.split("+cu")[0],
        "transformer_engine": transformer_engine_available(),
        "megatron_core": version("megatron-core"), "vllm": version("vllm") if importlib.util.find_spec("vllm") else None,
        "varlen": varlen_form(torch_varlen_attn()) is not None,
        **{f"pin:{p}": version(p) for image in IMAGES.values() for p in image.pins},
    }


def mismatches(image: Image, found: dict) -> list[str]:
    """The statements of ``image`` that ``found`` (:func:`installed_versions`) contradicts; a None statement (not
    known before the build) is not checked. megatron-core "0.11" matches any 0.11.x."""
    out = []
    for key in ("python", "torch", "transformer_engine", "megatron_core", "vllm", "varlen"):
        want, got = getattr(image, key), found.get(key)
        if want is None and key not in ("vllm",):
            continue
        ok = (got == want) if not isinstance(want, str) else (got is not None and (
            got == want or (key == "megatron_core" and got.startswith(want + "."))))
        if not ok:
            out.append(f"{key}: the table states {want!r}, the image has {got!r}")
    for pkg, want in image.pins.items():
        if found.get(f"pin:{pkg}") != want:
            out.append(f"{pkg}: the Dockerfile pins {want}, the image has {found.get(f'pin:{pkg}')!r}")
    return out


def check_installed(name: str) -> int:
    """Exit status of the build-time check of image ``name``: 0 when this environment is what :data:`IMAGES` states
    (printing it), 1 with each contradiction."""
    found = installed_versions()
    problems = mismatches(IMAGES[name], found)
    print(f"image {IMAGES[name].describe()}")
    print("found " + ", ".join(f"{k} {v}" for k, v in found.items() if not k.startswith("pin:")))
    for p in problems:
        print(f"image check: {p}")
    return 1 if problems else 0


if __name__ == "__main__":  # python -m laconic_nemo.plan.images NAME (the Dockerfiles' last build step)
    import sys

    sys.exit(check_installed(sys.argv[1]))
