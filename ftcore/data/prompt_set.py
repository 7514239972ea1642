"""`data.format=prompt`, objective=grpo's data: prompt-only records as TRL's GRPOTrainer takes them,
tokenized as it tokenizes them, and the layout-independent order they are drawn in.

A record is `{"prompt": "text", ...}` (standard) or `{"prompt": [{"role", "content"}, ...], ...}`
(conversational); every other key is a column handed to the reward functions as TRL hands them
(`f(prompts, completions, completion_ids, **columns)`, one value per completion). The prompt ids
are TRL 1.16's (`GRPOTrainer._tokenize_prompts`): a standard prompt is `tokenizer(text)`, with the
tokenizer's special tokens; a conversational one is `apply_chat_template(messages,
add_generation_prompt=True)` with data.chat_template's template.

Records are read through the data pipeline's reader (data/sources.py); one that cannot be a
prompt is a BadRecord (exit 2 naming file and line, or a counted skip with
data.on_bad_record=skip). A prompt so long that no completion of max_completion_length fits
data.seq_len is dropped and counted, as DPO drops a prompt that fills the row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch.distributed as dist

from ftcore.data.sampler import Sampler
from ftcore.data.templates import ROLES, BadRecord, Renderer
from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")


@dataclass
class Prompt:
    ids: list[int]  # the prompt's token ids, as TRL tokenizes it
    prompt: object  # the record's prompt (a string or a message list): what rewards receive
    columns: dict  # the record's other keys


@dataclass
class PromptSet:
    prompts: list[Prompt] = field(default_factory=list)
    bad_records: int = 0
    dropped: int = 0  # too long for data.seq_len with a whole completion


def is_conversational(prompt) -> bool:
    """TRL's test: a list of messages (dicts with a role)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def prompt_ids(renderer: Renderer, rec) -> tuple[list[int], object, dict]:
    """(ids, prompt, columns) of a prompt record; BadRecord when it is not one."""
    if not isinstance(rec, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(rec).__name__}")
    prompt = rec.get("prompt")
    columns = {k: v for k, v in rec.items() if k != "prompt"}
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRecord('the "prompt" is empty')
        return list(renderer.tok(prompt)["input_ids"]), prompt, columns
    if not isinstance(prompt, list) or not prompt:
        raise BadRecord('"prompt" must be a string or a non-empty list of {"role", "content"}')
    for i, m in enumerate(prompt):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ROLES
            or not isinstance(m.get("content"), str)
        ):
            raise BadRecord(f'prompt[{i}] must be {{"role": {"|".join(ROLES)}, "content": "text"}}')
    if renderer.template is None:
        raise BadRecord("message lists need a chat template (data.chat_template)")
    try:
        out = renderer.tok.apply_chat_template(
            prompt,
            chat_template=renderer.template,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=True,
        )
    except Exception as e:  # jinja raises from inside templates (e.g. roles must alternate)
        raise BadRecord(f"the chat template failed: {type(e).__name__}: {e}") from e
    return list(out["input_ids"]), prompt, columns


def load_prompts(cfg, tokenizer, path: str, needed: tuple[str, ...] = ()) -> PromptSet:
    """Every usable prompt of `path` (up to data.max_samples); `needed`: the columns the
    built-in rewards read, which every record must have."""
    from ftcore.data import sources

    d, o = cfg.data, cfg.objective
    renderer = Renderer(tokenizer, "prompt", d.chat_template)  # a template only if there is one
    room = d.seq_len - o.max_completion_length
    out = PromptSet()
    for where, rec in sources.iter_records(sources.resolve(path)):
        if d.max_samples is not None and len(out.prompts) >= d.max_samples:
            break
        try:
            if isinstance(rec, Exception):
                raise rec
            ids, prompt, columns = prompt_ids(renderer, rec)
            missing = [c for c in needed if c not in columns]
            if missing:
                raise BadRecord(f'missing column "{missing[0]}" (a reward reads it)')
        except (BadRecord, sources.RecordError) as e:
            if d.on_bad_record != "skip":
                raise FtcoreError(f"{where}: {e}", field="data.path",
                                  fix="fix or remove the record, or data.on_bad_record=skip") from None  # fmt: skip
            out.bad_records += 1
            continue
        if len(ids) > room:
            out.dropped += 1
            continue
        out.prompts.append(Prompt(ids, prompt, columns))
    if not out.prompts:
        raise FtcoreError(
            f"{path} holds no usable prompt ({out.dropped} longer than data.seq_len - "
            f"objective.max_completion_length = {room} tokens, {out.bad_records} bad records)",
            field="data.seq_len",
            fix="raise data.seq_len, lower objective.max_completion_length, or check the records",
        )
    return out


class PromptLoader:
    """The prompts of each rollout, from one endless stream in a seeded order that does not depend
    on the layout (data/sampler.py: its position is the resume state)."""

    def __init__(self, cfg, prompts: PromptSet):
        n = len(prompts.prompts)
        self.prompts = prompts.prompts
        self.per_step = cfg.train.global_batch_size // cfg.objective.num_generations
        self.sampler = Sampler([np.arange(n)], [n], np.ones(n, np.int64), 1, False, cfg.run.seed)
        self.report = {"samples": n, "unit": "prompts", "bad_records": prompts.bad_records,
                       "dropped": prompts.dropped, "rows": n}  # fmt: skip

    def next_prompts(self) -> list[int]:
        """The ids (positions in the prompt table) of the next rollout's prompts."""
        return [r[0] for r in self.sampler.take(self.per_step)]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, d: dict) -> None:
        self.sampler.load_state_dict(d)


def build_prompt_loader(cfg, tokenizer, needed: tuple[str, ...] = ()) -> PromptLoader:
    from ftcore.data.pipeline import bundled_data

    path = cfg.data.path or bundled_data("train", "prompt")
    loader = PromptLoader(cfg, load_prompts(cfg, tokenizer, path, needed))
    r = loader.report
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("data (train): %d prompts of %s; dropped %d (longer than data.seq_len - "
                 "objective.max_completion_length), bad records %d", r["samples"], path,
                 r["dropped"], r["bad_records"])  # fmt: skip
        if r["dropped"]:
            log.warning("%d prompts dropped: raise data.seq_len to keep them", r["dropped"])
    return loader
