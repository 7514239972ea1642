"""Every command README.md and docs/*.md show in ```bash blocks, run as a user pastes it (issue 52):
read from the pages at test time, so an edited page is what runs.

How, cheaply and honestly:
- all pages share one working directory, in order (README.md, then docs/*.md by name), so a page
  can use what an earlier command made (`outputs/mine`, `outputs/sft/hf_adapter`); a command shown
  twice (the same text) runs once;
- each command runs alone in bash with the clone's venv first on PATH (as after
  `. .venv/bin/activate`); a pipe into a tool that is not here (kubectl) runs up to that tool;
- what a user would replace is replaced, as they would: `outputs/<exp>/RUN` is the run an earlier
  command made there, its `checkpoints/step_<N>` the step that run reached; `/models/...` a tiny
  checkpoint of the family tests/data/docs_commands.yaml names; data files a page assumes
  (`pairs.jsonl`) are made first, from the bundled samples;
- the one change to a command as written: `python -m ftcore.train` without train.max_steps or
  train.epochs gets `train.max_steps=2` and `eval.max_samples=8`, `python -m ftcore.eval` the
  latter (the presets train 60 to 150 steps and generate 100 answers for their accuracy before and
  after: minutes each here); the quick start (train.epochs=1, one step) runs exactly as written;
- a command passes with exit 0, or the status its comment gives ("exit 2, \"...\"", with the quoted
  text in its output), and the output tests/data/docs_commands.yaml expects;
- the `generate with:` line a training run prints is run too (a prompt in place of its `...`)
  where it carries the user's own model (model.hf_path with its layout and launcher: what a line
  without the run's overrides got wrong, issue 52); a run that stops with exit 3 has its
  `resume with:` line run;
- what cannot run here (GPUs, SLURM, Kubernetes, containers, the suite itself) is listed with the
  reason in tests/data/docs_commands.yaml, whose ftcore commands are composed (`--cfg job`).
The README quick start's promises are checked on what it made: the adapter changes the model, at
the lr its step line logs; PEFT loads it by a base path that resolves; the files follow the umask.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
TABLE = ROOT / "tests" / "data" / "docs_commands.yaml"
SHELLS = ("bash", "sh", "shell", "console")
CAP = "train.max_steps=2"
SAMPLES = "eval.max_samples=8"
PROMPT = "What is 2 + 3?"


@dataclass(frozen=True)
class Shown:
    """One command as a page shows it."""

    page: str
    line: int
    text: str  # continuation lines joined, the comment removed, whitespace collapsed
    comment: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment): the comment starts at a `#` outside quotes at the start of a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shown(page: Path) -> list[Shown]:
    """The commands of the page's shell blocks (console blocks: the `$ ` lines)."""
    out, lang, pending, comments, start = [], None, "", [], 0
    for n, raw in enumerate(page.read_text().splitlines(), 1):
        if raw.lstrip().startswith("```"):
            lang = raw.strip()[3:].strip() if lang is None else None
            continue
        if lang not in SHELLS:
            continue
        if lang == "console":
            if not raw.startswith("$ "):
                continue
            raw = raw[2:]
        code, comment = split_comment(raw)
        if not code.strip() and not pending:
            continue
        start = start if pending else n
        comments.append(comment)
        if code.endswith("\\"):
            pending += code[:-1] + " "
            continue
        text = " ".join((pending + code).split())
        out.append(
            Shown(str(page.relative_to(ROOT)), start, text, " ".join(c for c in comments if c))
        )
        pending, comments = "", []
    return out


def documented() -> list[Shown]:
    return [c for p in pages() for c in shown(p)]


def table() -> dict:
    return yaml.safe_load(TABLE.read_text())


def entry(kind: str, text: str) -> dict | None:
    return next((e for e in table().get(kind) or [] if re.search(e["match"], text)), None)


def pipeline(text: str) -> list[str]:
    """The parts of a pipeline (`|` outside quotes)."""
    parts, quote, cur = [], None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "|":
            parts.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return [*parts, cur.strip()]


def ftcore_argv(part: str) -> tuple[str, list[str]] | None:
    """(module, its arguments) of the ftcore program a command part runs, if it runs one."""
    try:
        words = shlex.split(part)
    except ValueError:
        return None
    for i, w in enumerate(words[:-1]):
        if w == "-m" and words[i + 1].startswith("ftcore."):
            return words[i + 1], words[i + 2 :]
    return None


# ---- the cheap checks: the table against the pages ------------------------------------------------


def test_every_table_entry_matches_a_documented_command():
    """A stale entry (its command edited away) would hide nothing and test nothing: refused. Each
    documented command is classified one way at most."""
    texts = [c.text for c in documented()]
    assert len(texts) > 40, texts  # the pages were read
    t = table()
    for kind in ("not_run", "known_failing", "expect"):
        for e in t.get(kind) or []:
            assert any(re.search(e["match"], x) for x in texts), (
                f"{kind}: {e['match']} matches no command"
            )
    for x in texts:
        assert not (entry("not_run", x) and entry("known_failing", x)), x
    for m in t.get("models") or []:
        assert any(m["path"] in x for x in texts), f"models: {m['path']} is in no command"


def test_comments_are_cut_where_bash_cuts_them():
    assert split_comment("make train   # creates .venv") == ("make train", "creates .venv")
    assert split_comment('echo "What\'s 3 + 3?" > prompt.txt') == (
        'echo "What\'s 3 + 3?" > prompt.txt',
        "",
    )
    assert split_comment("python -c \"print('#x')\"  # y") == ("python -c \"print('#x')\"", "y")
    assert pipeline("python -m ftcore.launch.k8s a='x|y' | kubectl apply -f -") == [
        "python -m ftcore.launch.k8s a='x|y'",
        "kubectl apply -f -",
    ]


# ---- running them ------------------------------------------------------------------------------------


@dataclass
class Session:
    cwd: Path
    env: dict
    made: dict = field(default_factory=dict)  # placeholder -> what replaced it
    results: list = field(default_factory=list)  # (what ran, status, seconds, stdout, stderr)
    failures: list = field(default_factory=list)
    followed: set = field(default_factory=set)  # the overrides generate with: lines carried

    def run(self, what: str, command: str, timeout: int = 600) -> subprocess.CompletedProcess:
        t0 = time.perf_counter()
        p = subprocess.run(["bash", "-c", "umask 002\n" + command], cwd=self.cwd, env=self.env,
                           capture_output=True, text=True, timeout=timeout)  # fmt: skip
        self.results.append(
            (what, command, p.returncode, time.perf_counter() - t0, p.stdout, p.stderr)
        )
        print(f"{self.results[-1][3]:6.1f} s  exit {p.returncode}  {what}", flush=True)  # with -s
        return p

    def fail(self, what: str, command: str, p: subprocess.CompletedProcess, why: str) -> None:
        tail = (p.stderr or p.stdout)[-1500:]
        self.failures.append(f"{what}\n  ran: {command}\n  {why} (exit {p.returncode})\n{tail}")


def make_session(root: Path) -> Session:
    cwd = root / "work"
    cwd.mkdir()
    (cwd / ".venv").symlink_to(Path(sys.prefix))  # the clone's venv, as `make train` left it
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "LOCAL_RANK")
    }
    env.update(PATH=f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               VIRTUAL_ENV=str(sys.prefix), FTCORE_LOG_LEVEL="INFO", HF_HUB_OFFLINE="1")  # fmt: skip
    s = Session(cwd, env)
    for name, spec in (table().get("files") or {}).items():
        if "bundled" in spec:
            shutil.copy(ROOT / "ftcore" / "assets" / "data" / spec["bundled"], cwd / name)
        else:
            recs = [
                {"text": f"{i} plus {i} is {2 * i}. The word lemon backwards is nomel."}
                for i in range(spec["text"])
            ]
            (cwd / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    models = root / "models"
    for m in table().get("models") or []:
        from tests.support.hf_helpers import make_tiny_hf
        from tests.support.moe import make_tiny_moe

        out = models / m["path"].strip("/").replace("/", "_")
        make_tiny_hf(out) if m["family"] == "llama" else make_tiny_moe(out, m["family"])
        s.made[m["path"]] = str(out)
    return s


def newest_run(cwd: Path, exp: str) -> Path | None:
    runs = [d for d in (cwd / "outputs" / exp).glob("*") if (d / "config.yaml").is_file()]
    return max(runs, key=lambda d: d.stat().st_mtime) if runs else None


def substitute(s: Session, text: str) -> str:
    """What a user types in place of the placeholders (see the module docstring)."""
    for path, made in s.made.items():
        text = text.replace(path, made)

    def run_dir(m: re.Match) -> str:
        run = newest_run(s.cwd, m.group(1))
        return str(run.relative_to(s.cwd)) if run else m.group(0)

    text = re.sub(r"outputs/([\w.-]+)/RUN\b", run_dir, text)

    def step(m: re.Match) -> str:
        ckpt = s.cwd / m.group(1)
        if (ckpt / m.group(2)).is_dir() or not (ckpt / "latest").is_file():
            return m.group(0)
        return f"{m.group(1)}/{(ckpt / 'latest').read_text().strip()}"

    return re.sub(r"(outputs/[\w./-]+/checkpoints)/(step_\d+)", step, text)


def capped(part: str) -> str:
    """A training command that sets neither its steps nor its epochs gets `train.max_steps=2`, and
    it or an evaluation that sets no eval.max_samples gets `eval.max_samples=8` (the presets'
    exact-match accuracy generates 100 answers before and after training: most of such a run)."""
    prog = ftcore_argv(part)
    if prog is None or prog[0] not in ("ftcore.train", "ftcore.eval") or "--cfg" in prog[1]:
        return part
    if any(a.startswith(("train.max_steps=", "train.epochs=")) for a in prog[1]):
        return part
    if any(a.startswith("eval.max_samples=") for a in prog[1]):
        return f"{part} {CAP}" if prog[0] == "ftcore.train" else part
    return f"{part} {CAP if prog[0] == 'ftcore.train' else ''} {SAMPLES}".replace("  ", " ")


def expected_status(c: Shown) -> tuple[int, list[str]]:
    """The exit status and output the comment of an ftcore command promises ("exit 2, \"...\"");
    else 0. (A comment on another command may speak of a run it affects: `touch STOP`.)"""
    m = re.search(r"\bexit (\d)\b", c.comment)
    if not m or not any(ftcore_argv(x) for x in pipeline(c.text)):
        return 0, []
    return int(m.group(1)), re.findall(r'"([^"]+)"', c.comment)


def follow_printed(s: Session, c: Shown, p: subprocess.CompletedProcess) -> None:
    """The `resume with:` line of a stopped run, and the `generate with:` line of a finished one
    where it carries the run's model (model.hf_path=DIR, with its layout and launcher): run as
    printed, once per set of carried keys. (test_run_output.py runs one carrying data.seq_len.)"""
    out = p.stderr + p.stdout
    if p.returncode == 3 and "resume with: " in out:
        line = out.split("resume with: ", 1)[1].splitlines()[0]
        r = s.run(f"{c} -> resume with:", line)
        if r.returncode != 0:
            s.fail(f"{c} -> its resume with: line", line, r, "the printed command failed")
    if p.returncode != 0 or "generate with: " not in out:
        return
    line = out.split("generate with: ", 1)[1].splitlines()[0].replace('"..."', f'"{PROMPT}"')
    own = ("+exp=", "peft.adapter_path=", "model.hf_path=outputs/", "generate.prompt=")
    carried = frozenset(a.split("=")[0] for a in shlex.split(line)[3:] if not a.startswith(own))
    if not any(k.startswith("model.") for k in carried) or carried in s.followed:
        return  # the user's own checkpoint (model.hf_path=...): what a bare line would lose
    s.followed.add(carried)
    r = s.run(f"{c} -> generate with:", line)
    if r.returncode != 0 or len(r.stdout.splitlines()) != 1:
        s.fail(f"{c} -> its generate with: line", line, r, "the printed command failed")


def run_shown(s: Session, c: Shown) -> None:
    known = entry("known_failing", c.text)
    parts = [x for x in pipeline(c.text) if not entry("not_run", x)]
    command = " | ".join(capped(substitute(s, x)) for x in parts)
    p = s.run(str(c), command)
    if known:
        if p.returncode == 0:
            s.fail(str(c), command, p, f"now runs: remove its known_failing entry ({known['why']})")
        return
    status, quoted = expected_status(c)
    want = [*quoted, *((entry("expect", c.text) or {}).get("output") or [])]
    missing = [w for w in want if w not in p.stderr + p.stdout]
    if p.returncode != status or missing:
        s.fail(
            str(c), command, p, f"expected exit {status}" + (f" and {missing}" if missing else "")
        )
        return
    prog = ftcore_argv(parts[-1])
    if prog and prog[0] == "ftcore.train":
        follow_printed(s, c, p)


def compose_only(s: Session, c: Shown) -> None:
    """A command that cannot run here: its ftcore part, composed (`--cfg job`): every key valid."""
    prog = next((ftcore_argv(x) for x in pipeline(c.text) if ftcore_argv(x)), None)
    if prog is None:
        return
    command = shlex.join(["python", "-m", prog[0], *prog[1], "--cfg", "job"])
    p = s.run(f"{c} (composed)", command)
    if p.returncode != 0:
        s.fail(f"{c} (composed: it does not run here)", command, p, "its config does not compose")


def quick_start_promises(s: Session) -> None:
    """What README.md's quick start promises of what it made (outputs/mine)."""
    from tests.support.adapters import trained_and_logged

    adapter = s.cwd / "outputs" / "mine" / "hf_adapter"
    steps = [r for r in s.results if "run.dir=outputs/mine" in r[1] and "ftcore.train" in r[1]]
    assert steps and steps[0][2] == 0, steps
    trained_and_logged(steps[0][5], adapter)
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str((ROOT / "ftcore" / "assets" / "tiny_base").resolve())
    for f in adapter.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o664, f  # umask 002
    gen = next(
        r
        for r in s.results
        if r[0].startswith("README.md") and "generate.prompt_file=prompt.txt" in r[1]
    )
    assert len(gen[4].splitlines()) == 1 and gen[4].strip(), gen[4]  # the answer alone
    peft = next(
        r for r in s.results if r[0].startswith("README.md") and "AutoPeftModelForCausalLM" in r[1]
    )
    assert peft[4].strip() == "PeftModelForCausalLM", peft[4]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~40 commands; a shared, loaded machine takes several times their time
def test_every_documented_command_runs(tmp_path):
    s = make_session(tmp_path)
    seen = set()
    for c in documented():
        if c.text in seen:
            continue  # shown again (quickstart.md repeats README.md's): it ran once
        seen.add(c.text)
        skip = entry("not_run", c.text)
        if skip:
            if skip.get("compose"):
                compose_only(s, c)
            continue
        run_shown(s, c)
    timings = "\n".join(f"{r[3]:6.1f} s  exit {r[2]}  {r[0]}" for r in s.results)
    print(f"{len(s.results)} commands, {sum(r[3] for r in s.results):.0f} s:\n{timings}")
    assert not s.failures, "\n\n".join(s.failures) + "\n\n" + timings
    quick_start_promises(s)
