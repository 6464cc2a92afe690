"""Does greedy decoding with a drafter reproduce plain greedy decoding?

For every prompt of the corpus (bench/corpus.json: json extraction after a
long rules prompt, support replies, short stories, code), generate greedily
through the daemon once without drafting (draft_tokens=0) and once per k, and
compare the token ids. For each divergence, report the position and the
target's top-2 logit gap there on the plain path (small gap = a near-tie that
batched and single-token kernels may round differently).

    python -m bench.fidelity --target PATH --drafter PATH|ngram [--k 1 2 4 6] [--flash-attn on|off]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.common import start_daemon, temp_socket
from tandem.client import Client
from tandem.protocol import ChatMessage, Generate

CORPUS = Path(__file__).with_name("corpus.json")


def load_corpus() -> dict[str, list[list[dict]]]:
    return json.loads(CORPUS.read_text())


@dataclass
class Divergence:
    kind: str
    prompt_index: int
    k: int
    position: int
    top2_gap: float


@dataclass
class FidelityResult:
    total: dict[int, int] = field(default_factory=dict)
    identical: dict[int, int] = field(default_factory=dict)  # k -> outputs equal to draft_tokens=0 in the same daemon
    identical_to_single: dict[int, int] = field(default_factory=dict)  # k -> equal to one-token plain decoding
    divergences: list[Divergence] = field(default_factory=list)
    plain_equals_single: int = 0  # the daemon's own plain path vs one-token plain decoding
    prompts: int = 0


def token_ids(client: Client, messages, tokens: int, k: int) -> list[int]:
    stream = client.generate(messages=messages, max_tokens=tokens, temperature=0.0, draft_tokens=k)
    return [t for chunk in stream for t in chunk.token_ids]


def top2_gap(engine, messages, prefix: list[int]) -> float:
    """The target's logit gap between its two best tokens after prompt + prefix."""
    model = engine.model
    prompt = engine.prompt_tokens(Generate(id="gap", messages=[ChatMessage(**m) for m in messages]))
    model.clear()
    logits = model.decode(prompt + prefix)[0]
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def single_token_reference(engine, messages, tokens: int) -> list[int]:
    """Plain greedy decoding one token per step, in this process: what a daemon
    without a drafter produces."""
    req = Generate(id="ref", messages=[ChatMessage(**m) for m in messages], max_tokens=tokens, temperature=0.0)
    out: list[int] = []
    engine.run(req, lambda chunk: out.extend(chunk.token_ids), lambda: False)
    return out


def compare(client: Client, corpus, ks, tokens: int, engine=None, kinds=None) -> FidelityResult:
    result = FidelityResult()
    for kind, prompts in corpus.items():
        if kinds and kind not in kinds:
            continue
        for i, messages in enumerate(prompts):
            plain = token_ids(client, messages, tokens, 0)
            single = single_token_reference(engine, messages, tokens) if engine is not None else plain
            result.prompts += 1
            result.plain_equals_single += plain == single
            for k in ks:
                drafted = token_ids(client, messages, tokens, k)
                result.total[k] = result.total.get(k, 0) + 1
                result.identical_to_single[k] = result.identical_to_single.get(k, 0) + (drafted == single)
                if drafted == plain:
                    result.identical[k] = result.identical.get(k, 0) + 1
                    continue
                pos = next((j for j, (a, b) in enumerate(zip(plain, drafted)) if a != b), min(len(plain), len(drafted)))
                gap = top2_gap(engine, messages, plain[:pos]) if engine is not None else float("nan")
                result.divergences.append(Divergence(kind, i, k, pos, gap))
    return result


def reference_engine(target: str, flash_attn: bool, n_ctx: int = 2048, reference_kernels: bool = True):
    from tandem.daemon.models.chat import ChatTemplate
    from tandem.daemon.worker.engine import Engine
    from tandem.daemon.worker.llama_model import LlamaModel

    model = LlamaModel(target, n_ctx=n_ctx, flash_attn=flash_attn, reference_kernels=reference_kernels)
    template = ChatTemplate(
        model.chat_template(),
        bos_token=model.token_text(model.bos_token, special=True).decode(),
        eos_token=model.token_text(model.eos_token, special=True).decode(),
    )
    return Engine(model, template)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 6])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--flash-attn", choices=["on", "off"], default="on")
    ap.add_argument("--exact", choices=["auto", "off"], default="auto")
    ap.add_argument("--kinds", nargs="*", default=None)
    args = ap.parse_args()
    socket = temp_socket("tdm-fid-")
    daemon = start_daemon(
        socket,
        "--model",
        args.target,
        "--drafter",
        args.drafter,
        "--flash-attn",
        args.flash_attn,
        "--exact",
        args.exact,
        "--ctx-size",
        "2048",
    )
    try:
        engine = reference_engine(args.target, args.flash_attn == "on")
        with Client(socket) as client:
            t0 = time.perf_counter()
            res = compare(client, load_corpus(), args.k, args.tokens, engine, args.kinds)
            elapsed = time.perf_counter() - t0
    finally:
        daemon.terminate()
        daemon.wait(30)
    print(
        f"target {Path(args.target).name}, drafter {Path(args.drafter).name}, flash-attn {args.flash_attn}, "
        f"exact {args.exact}, {args.tokens} tokens, {elapsed:.0f} s"
    )
    print(
        f"the daemon's plain path (draft_tokens=0) equals one-token plain decoding in "
        f"{res.plain_equals_single} of {res.prompts}"
    )
    for k in args.k:
        print(
            f"k={k}: identical to the daemon's plain path in {res.identical.get(k, 0)} of {res.total.get(k, 0)}; "
            f"to one-token plain decoding in {res.identical_to_single.get(k, 0)} of {res.total.get(k, 0)}"
        )
    for d in res.divergences:
        print(f"  diverged: {d.kind}[{d.prompt_index}] k={d.k} at token {d.position}, top-2 logit gap {d.top2_gap:.4f}")


if __name__ == "__main__":
    main()
