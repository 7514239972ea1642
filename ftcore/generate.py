"""`python -m ftcore.generate +exp=NAME [model.hf_path=DIR] [peft.adapter_path=DIR]
generate.prompt="..." [generate.max_new_tokens=N] [generate.temperature=T]`: the chat template is
applied to the prompt and the answer alone is printed on standard output. The decoding itself
lives in ftcore/inference/generation.py.
"""

from __future__ import annotations

from functools import partial

from omegaconf import DictConfig

from ftcore.cli import run
from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files

PROMPT_ENV = "FTCORE_STDIN_PROMPT"  # standard input, read once by the process the user started


def read_prompt(cfg: DictConfig) -> str:
    """The prompt: `generate.prompt`, or the text of `generate.prompt_file` (`-`: standard input,
    read only when asked). A file takes any text (commas, quotes, `=`, newlines) that Hydra's
    parser would reject on the command line."""
    import os
    import sys
    from pathlib import Path

    g = cfg.generate
    if g.prompt and g.prompt_file:
        raise FtcoreError("both generate.prompt and generate.prompt_file are set",
                          field="generate.prompt_file", fix="give one of the two")  # fmt: skip
    if not g.prompt_file:
        text = g.prompt
    elif g.prompt_file == "-":
        # local workers cannot all read the one standard input: the first process reads it
        if PROMPT_ENV not in os.environ:
            os.environ[PROMPT_ENV] = sys.stdin.read()
        text = os.environ[PROMPT_ENV]
    else:
        path = Path(g.prompt_file).expanduser()
        if not path.is_file():
            raise FtcoreError(f"no such file: {path}", field="generate.prompt_file",
                              fix="a text file holding the prompt, or - to read standard input")  # fmt: skip
        text = safe_files.read_text(path, "generate.prompt_file")
    text = (text or "").strip()
    if not text:
        raise FtcoreError("no prompt given", field="generate.prompt",
                          fix='generate.prompt="What is 2 + 3?" or generate.prompt_file=PATH')  # fmt: skip
    return text


def generate(cfg: DictConfig) -> str:
    """Print the answer, alone, on standard output (rank 0); logs go to standard error."""
    from ftcore.inference.generation import generate_ids, prompt_ids, stop_ids
    from ftcore.training import trainer

    g = cfg.generate
    prompt = read_prompt(cfg)
    if g.max_new_tokens < 1:
        raise FtcoreError("max_new_tokens must be >= 1", field="generate.max_new_tokens",
                          fix="generate.max_new_tokens=64 (or any count >= 1)")  # fmt: skip
    state = trainer.setup(cfg, data=False, kind="generate")
    tok = state.tokenizer
    (ids,) = generate_ids(state, [prompt_ids(state, prompt, g.system)], max_new_tokens=g.max_new_tokens,
                          temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, stop=stop_ids(tok),
                          pad_id=tok.pad_token_id or 0, seed=cfg.run.seed)  # fmt: skip
    text = tok.decode(ids, skip_special_tokens=True)
    if state.info.rank == 0:
        print(text, flush=True)
    return text


def task(cfg: DictConfig) -> int | None:
    import os

    from ftcore.precision.decode import decode_safe
    from ftcore.runtime import gpu_env
    from ftcore.validation import checks, preflight

    # FP8/FP4, userbuffers and CUDA graphs cannot run at decode shapes: BF16, none of them
    decode_safe(cfg, say=os.environ.get("RANK", "0") == "0")
    gpu_env.at_process_start(cfg)  # before CUDA/NCCL initialise, whoever started this process
    # first: on a machine without a GPU nothing else matters
    preflight.require_cuda(cfg, "generate")
    preflight.use_adapter(cfg, training=False)  # an adapter path is loaded, never dropped
    read_prompt(cfg)  # a missing prompt or prompt file exits 2 before any worker starts
    checks.check_generation(cfg)
    from ftcore.runtime import dist as rdist

    status = rdist.launch_standalone(
        cfg, "ftcore.generate", partial(checks.check_for_launch, training=False)
    )
    if status is not None:
        return status
    try:
        generate(cfg)
    finally:
        rdist.teardown()
    return None


if __name__ == "__main__":
    run("generate", task)
