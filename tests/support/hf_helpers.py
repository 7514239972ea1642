"""A tiny random Hugging Face model made in a temp dir (GQA, llama3 rope scaling with all four fields
away from megatron's defaults, a vocab size TP does not divide) and worker-side cases that load it
into ftcore under a layout and return logits, the eval loss and an exported hf_model/.

`family` picks the transformers class (ftcore/config/families.py): llama (the default), qwen2
(random q/k/v biases), qwen3 (random q/k norms, head_dim != hidden / heads), mistral (a sliding
window longer than the test sequences, which changes nothing)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from tests.support.tiny import TINY

VOCAB = 2053  # odd: TP=2 does not divide it (padded to 2176 at TP=1, 2304 at TP=2)
ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
        "original_max_position_embeddings": 96}  # fmt: skip
SEQ = 32


FAMILY_KW = {
    "llama": {},
    "qwen2": {"use_sliding_window": False, "sliding_window": 16},  # the key is there, switched off
    "qwen3": {"head_dim": 32, "attention_bias": False},  # q dim 128 != hidden 64
    "mistral": {"sliding_window": 256},  # >= every test sequence: not refused, masks nothing
}


def config_class(family: str = "llama"):
    import transformers

    return getattr(transformers, {"llama": "LlamaConfig", "qwen2": "Qwen2Config",
                                  "qwen3": "Qwen3Config", "mistral": "MistralConfig"}[family])  # fmt: skip


def hf_config(vocab: int = VOCAB, tie: bool = False, family: str = "llama", **over):
    LlamaConfig = config_class(family)  # noqa: N806 - a class

    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=2032, eos_token_id=2033)  # fmt: skip
    kw.update(FAMILY_KW[family])
    kw.update(over)
    scaling = ROPE if family == "llama" else {"rope_type": "default"}  # the others: plain RoPE
    if "rope_parameters" in getattr(LlamaConfig, "__dataclass_fields__", {}) or hasattr(
        LlamaConfig(), "rope_parameters"
    ):
        kw["rope_parameters"] = dict(scaling, rope_theta=5000.0)
    else:
        kw.update(rope_theta=5000.0, rope_scaling=scaling if family == "llama" else None)
    return LlamaConfig(**kw)


@torch.no_grad()
def make_tiny_hf(path: str | Path, *, tie: bool = False, seed: int = 0, max_shard_size: str = "150KB",
                 family: str = "llama", **over) -> Path:  # fmt: skip
    """Random model with O(1) activations (so a mapping error shows in the logits), saved in shards
    with an index, plus a Llama-3 base tokenizer (eos = <|end_of_text|>)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(tie=tie, family=family, **over))
    randomize(model)
    return save_with_tokenizer(model, path, max_shard_size)


@torch.no_grad()
def randomize(model) -> None:
    """Weights with O(1) activations, drawn in parameter order from torch's global generator (the
    caller seeds it): norms near 1, biases and embeddings O(1), linears (2D and transformers' 3D
    fused experts) scaled by their input width, a router wider still so its top-k choice is
    not decided by rounding. The dense, MoE and DeepSeek-class tiny checkpoints all use it."""
    model.float().eval()
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif name.endswith(".bias"):
            p.copy_(0.5 * torch.randn_like(p))
        elif "embed_tokens" in name:
            p.copy_(torch.randn_like(p))
        elif name.endswith("gate.weight"):  # an MoE router: clear top-k choices
            p.copy_(2.0 * torch.randn_like(p) / p.shape[-1] ** 0.5)
        else:
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)


def save_with_tokenizer(model, path: str | Path, max_shard_size: str = "150KB") -> Path:
    """save_pretrained in shards (with an index), plus the bundled Llama-3 base tokenizer with
    eos = <|end_of_text|>."""
    from transformers import AutoTokenizer

    from ftcore.data.tokenizer import bundled_tokenizer_dir

    path = Path(path)
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    tok = AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir()))
    tok.eos_token = "<|end_of_text|>"
    tok.save_pretrained(str(path))
    return path


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def tokens(batch: int = 2, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(seed))


def write_text_data(path: str | Path, n: int = 11, seed: int = 0) -> Path:
    """JSONL `text` records of varied length; some exceed data.seq_len and get truncated."""
    words = [
        "plum",
        "mirror",
        "feather",
        "7",
        "+",
        "=",
        "street",
        "carpet",
        "learn",
        "star",
        "42",
        "the",
    ]
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(
                json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))})
                + "\n"
            )
    return Path(path)


@torch.no_grad()
def hf_text_loss(path, data: str | Path, seq_len: int = SEQ) -> dict:
    """HF's own loss on data.format=text: tokenizer(text)["input_ids"] + [eos], truncated to seq_len,
    every position after the first a target; token-weighted mean over all records."""
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    model, tok = hf_model(path), AutoTokenizer.from_pretrained(str(path))
    total, n = 0.0, 0
    for line in Path(data).read_text().splitlines():
        ids = (tok(json.loads(line)["text"])["input_ids"] + [tok.eos_token_id])[:seq_len]
        x = torch.tensor([ids])
        logits = model(input_ids=x).logits[0, :-1].double()
        total += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        n += len(ids) - 1
    return {"loss": total / n, "tokens": n}


def compose_hf(hf_dir: str, run_dir: str, overrides: list[str]):
    from ftcore.config.schema import compose

    return compose(TINY + [f"model.hf_path={hf_dir}", f"run.dir={run_dir}", "data.format=text",
                           f"data.seq_len={SEQ}"] + list(overrides))  # fmt: skip


def _logits_step(data_iterator, model):
    from megatron.core import tensor_parallel

    from ftcore.data.pipeline import attention_mask_from_segments
    from ftcore.runtime import cpu

    x = next(data_iterator)
    pos = torch.arange(x.shape[1]).unsqueeze(0).expand_as(x)
    mask = attention_mask_from_segments(torch.ones_like(x, dtype=torch.int32))
    with cpu.mode_suspended():
        out = model(x, pos, mask)

    def loss_func(output):
        full = tensor_parallel.gather_from_tensor_model_parallel_region(output)
        return torch.zeros(()), torch.tensor(1, dtype=torch.int), {"logits": full.detach().clone()}

    return out, loss_func


@torch.no_grad()
def forward_logits(state, x: torch.Tensor):
    """Full-vocab logits [b, s, vocab] on the last stage's ranks (None elsewhere), any layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ftcore.data.packing import microbatch_iterators
    from ftcore.runtime import cpu

    for chunk in state.model:
        chunk.eval()
    rows = list(x.split(1))  # one sequence per micro-batch (interleaving wants >= pp of them)
    with cpu.device_mode():
        out = get_forward_backward_func()(
            forward_step_func=_logits_step, data_iterator=microbatch_iterators(rows, len(state.model)),
            model=state.model if len(state.model) > 1 else state.model[0], num_microbatches=len(rows),
            seq_length=x.shape[1], micro_batch_size=1, forward_only=True,
        )  # fmt: skip
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat([o["logits"] for o in out])[..., : state.cfg.model.vocab_size].float()


def load_case(hf_dir: str, run_dir: str, overrides: list[str], x: torch.Tensor, data: str | None = None,
              export: bool = False, save: bool = False) -> dict:  # fmt: skip
    """Worker: load the HF model under a layout; logits (rank 0 of the last stage), eval, export,
    a checkpoint of the layout (step_0)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ftcore.training import trainer

    cfg = compose_hf(hf_dir, run_dir, list(overrides) + ([f"data.path={data}"] if data else []))
    state = trainer.setup(cfg, data=False)
    logits = forward_logits(state, x)
    out = {
        "logits": logits if ps.get_tensor_model_parallel_rank() == 0 else None,
        "rank": dist.get_rank(),
    }
    if data:
        from ftcore.eval import evaluate

        out["eval"] = evaluate(state.cfg, state)
    if export:
        from ftcore.hf.export import write_hf_model

        out["export"] = str(write_hf_model(state))
    if save:
        from ftcore.checkpoint import store

        store.save(state)
    return out


def save_case(hf_dir: str, run_dir: str, overrides: list[str], x: torch.Tensor) -> dict:
    """Worker: load under a layout, return logits, save a checkpoint (step_0) of that layout."""
    from megatron.core import parallel_state as ps

    from ftcore.checkpoint import store
    from ftcore.training import trainer

    state = trainer.setup(compose_hf(hf_dir, run_dir, overrides), data=False)
    logits = forward_logits(state, x)
    store.save(state)
    return {"logits": logits if ps.get_tensor_model_parallel_rank() == 0 else None}


def cli_status(module: str, argv: list[str]) -> tuple[int, str]:
    """Worker: run an entry point's task in-process through ftcore.cli.main; (status, stderr)."""
    import contextlib
    import importlib
    import io

    from ftcore.cli import main

    def task(cfg):  # like ftcore.eval.task without the launcher/teardown (the pool owns the group)
        importlib.import_module(module).evaluate(cfg)

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(module.rsplit(".", 1)[-1], task, argv)
    return status, err.getvalue()


def read_hf_dir(path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def assert_exported(out, want: dict, ref: dict, what: str) -> None:
    """`out` holds exactly `want`'s tensors, same dtype and bytes, and transformers loads it as the
    model of `ref["path"]` (the same logits on `ref["x"]`)."""
    got = read_hf_dir(out)
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))[:6]}"
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), f"{what}: {k} differs"
    back = hf_model(out)
    assert type(back) is type(hf_model(ref["path"]))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ref["x"]).logits.float(), ref["logits"])


def eval_case(hf_dir: str, run_dir: str, overrides: list[str]) -> dict:
    """Worker: ftcore.eval's evaluate() on a run built from the HF directory."""
    from ftcore.eval import evaluate

    return evaluate(compose_hf(hf_dir, run_dir, overrides))


def rel_error(a, b) -> float:
    """Largest elementwise error relative to the largest reference magnitude."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def check_against_hf(results, ref, what: str, rtol: float) -> None:
    """Every rank's logits and the eval loss (target tokens, perplexity) of a load_case run
    against transformers' (`ref`: "logits" and "loss" from hf_text_loss)."""
    import torch

    logits = [r["logits"] for r in results if r["logits"] is not None]
    assert logits, f"{what}: no rank returned logits"
    for got in logits:
        assert got.shape == ref["logits"].shape
        rel = rel_error(got, ref["logits"])
        assert rel <= rtol, f"{what}: logits differ from HF by {rel:.2e} (relative) > {rtol}"
        print(f"{what}: logits max error / max |logit| = {rel:.1e}")
    ev = results[0]["eval"]
    assert ev["tokens"] == ref["loss"]["tokens"], (
        f"{what}: {ev['tokens']} target tokens, HF has {ref['loss']['tokens']}"
    )
    rel = abs(ev["loss"] - ref["loss"]["loss"]) / ref["loss"]["loss"]
    assert rel <= rtol, f"{what}: eval loss {ev['loss']} vs HF {ref['loss']['loss']} ({rel:.2e})"
    print(
        f"{what}: eval loss {ev['loss']:.8f} vs HF {ref['loss']['loss']:.8f} (relative {rel:.1e})"
    )
    assert abs(ev["ppl"] - torch.tensor(ev["loss"]).exp().item()) < 1e-6 * ev["ppl"]
