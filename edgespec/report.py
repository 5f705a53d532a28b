"""Tables, JSON and PNG plots for benchmark results (matplotlib is optional: the `bench` extra)."""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from . import theory
from .outputs import usual_permissions


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one, else all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class OtherLoad:
    """The CPU time that other processes (and, in a VM, the hypervisor's steal) took on the cores
    this process may run on while it measured, in cores: (their busy time from /proc/stat - this
    process's own CPU time) / wall time, between construction and ``cores()``. Timings of a busy
    machine are low and noisy, and ONNX Runtime's spin-waiting threads suffer most from it; bench
    and demo say so instead of leaving the reader to guess. None where it cannot be told: no
    /proc/stat (not Linux), a run under half a second, or a cgroup CPU quota (a container limited by
    time, not by cores, may run on any of the host's cores, which other tenants share)."""

    def __init__(self, stat: str = "/proc/stat", cgroup: str = "/sys/fs/cgroup"):
        self._stat, self._cgroup = stat, cgroup
        self._cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else None
        self._start = None if self._quota() else self._sample()

    def _quota(self) -> bool:
        """A CPU time quota is set (cgroup v2 cpu.max, or v1 cpu.cfs_quota_us)."""
        for name, unlimited in (("cpu.max", "max"), ("cpu/cpu.cfs_quota_us", "-1")):
            try:
                with open(os.path.join(self._cgroup, name)) as f:
                    return f.read().split()[0] != unlimited
            except (OSError, IndexError):
                continue
        return False

    def _sample(self) -> tuple[float, float, float] | None:
        import time

        try:
            with open(self._stat) as f:
                lines = [line.split() for line in f if line.startswith("cpu")]
        except OSError:
            return None
        # the per-core lines of the cores this process may use; the all-cores line where those are missing
        mine = [f for f in lines if self._cpus is not None and f[0] in self._cpus]
        chosen = mine or [f for f in lines if f[0] == "cpu"]
        if not chosen:
            return None
        busy = 0
        for fields in chosen:
            try:
                # user nice system idle iowait irq softirq steal ... (USER_HZ ticks; guest is inside user)
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
            except ValueError:  # a line of another shape
                return None
            busy += user + nice + system + irq + softirq + steal
        return busy / os.sysconf("SC_CLK_TCK"), time.process_time(), time.perf_counter()

    def cores(self) -> float | None:
        end = self._sample() if self._start is not None else None
        if end is None or end[2] - self._start[2] < 0.5:  # too short for 10 ms ticks
            return None
        busy, own, wall = (e - s for e, s in zip(end, self._start))
        return max(0.0, (busy - own) / wall)


def warn_if_busy(cores: float | None) -> None:
    """After a measurement: an EdgeSpecWarning (one stderr line from the CLI) if other work took a
    noticeable share of the cores (see other_load_note)."""
    note = other_load_note(cores)
    if note:
        from .errors import warn

        warn(note)


def other_load_note(cores: float | None) -> str | None:
    """A warning when other work took a noticeable share of this process's cores during a measurement."""
    if cores is None or cores < 0.25:
        return None
    return (f"the machine was busy: other processes took {cores:.2f} of the {usable_cores()} cores this ran on, on "
            "average, so tokens/s are lower and noisier than on an idle machine (ratios are still side by side); "
            "stop other work and measure again")


def source_commit() -> str | None:
    """The git commit of the edgespec source that runs (an editable install of a checkout, with "+dirty"
    for uncommitted changes); None for an installed package or without git."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, timeout=10,  # noqa: E731
                                        check=True).stdout.strip()
        return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_description() -> dict:
    import numpy as np

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            # the cores this process may run on (a container's or taskset's limit), and the host's
            "cpu_count": usable_cores(), "host_cpu_count": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    try:
        import onnxruntime as ort

        info["onnxruntime"] = ort.__version__
    except ImportError:
        pass
    return info


def cell(x: float, spec: str = ".3f", missing: str = "-") -> str:
    """A measured value formatted, or ``missing`` where there is none (None or NaN)."""
    return missing if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def ratio_cell(x: float, missing: str = "-") -> str:
    """A ratio with its x, or ``missing`` where it was not measured (not "-x")."""
    text = cell(x, ".2f", missing)
    return text if text == missing else text + "x"


def format_table(rows: list[dict]) -> str:
    nan = float("nan")
    # (header, width, cell of a row): every cell right-aligned under its header
    cols = [("alpha", 6, lambda r: cell(r["alpha"])), ("c", 6, lambda r: cell(r["c"])),
            ("tok/round", 9, lambda r: cell(r["tokens_per_round"], ".2f")),
            ("(theory)", 8, lambda r: cell(r["expected_tokens_per_round"], ".2f")),
            ("plain tok/s", 11, lambda r: cell(r["plain_tokens_per_s"], ".1f")),
            ("spec tok/s", 10, lambda r: cell(r["spec_tokens_per_s"], ".1f")),
            ("speedup", 8, lambda r: ratio_cell(r["speedup"])),
            ("[IQR]", 13, lambda r: "[{}-{}]".format(*(cell(v, ".2f") for v in (r.get("speedup_iqr") or [nan] * 2)))),
            ("decode", 7, lambda r: ratio_cell(r.get("decode_speedup", nan))),
            ("Thm3.8", 7, lambda r: ratio_cell(r["predicted_speedup"])),
            ("V", 5, lambda r: cell(r.get("verify_cost_steps", nan), ".2f")),
            ("Thm3.8(V)", 9, lambda r: ratio_cell(r.get("predicted_speedup_verify_cost", nan))),
            ("fewer reads", 11, lambda r: ratio_cell(r.get("target_read_reduction", nan)))]
    first = max([34] + [len(r["setting"]) for r in rows])   # (top-k, top-p and lenience lengthen a label)
    head = f"{'setting':<{first}} " + " ".join(f"{h:>{w}}" for h, w, _ in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['setting']:<{first}} " + " ".join(f"{fmt(r):>{w}}" for _, w, fmt in cols))
    notes = ["speedup: end to end (prefill and first token included), the median of the per-repeat spec / plain "
             "ratios [their IQR]; decode: the rate after the first token "
             "(time per output token), the part a draft can speed up",
             "(theory): (1 - a^(g+1)) / (1 - a) averaged over the rounds, each at its own gamma (a round is "
             "shortened near --max-new-tokens, and adaptive gamma varies), so it can sit below the formula at the row's gamma",
             "c: a draft step's time over a verify call's; V: a verify call's time in plain target steps "
             "(Theorem 3.8 assumes 1)",
             "Thm3.8: the theorem with alpha and its c, a draft step over a plain target step (c x V, as "
             "`edgespec plan` takes it); Thm3.8(V): the prediction with the measured verify cost, "
             "E / ((gamma c + 1) V); with lenience < 1 the theory columns use the test's keep probability, not alpha",
             "fewer reads: the target's weight and KV bytes per token, plain over speculative (the draft's are "
             "in bench.json)"]
    return "\n".join(lines + notes)


def json_safe(obj):
    """``obj`` with every non-finite float as None: strict JSON has no NaN or Infinity (Python
    writes them, JavaScript's JSON.parse and Python's own strict mode reject them)."""
    import numpy as np

    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def write_json(path: Path, payload: dict) -> None:
    """Write atomically (a temporary file renamed into place), readable as the umask allows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(json_safe(payload), f, indent=2, default=float, allow_nan=False)
        usual_permissions(tmp)  # mkstemp makes it private (0600)
        os.replace(tmp, path)
    except BaseException as exc:  # (a full disk left the partial temporary file behind, and no name)
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = str(path)  # the CLI's message names the file
        raise


PLOT_FILES = ("speedup.png", "accepted_hist.png")  # what plot() writes into a bench --out


def plot(rows: list[dict], out_dir: Path) -> list[Path] | None:
    """speedup.png (measured vs Theorem 3.8 against gamma) and accepted_hist.png; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by_t: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["gamma"] is not None and r["draft"] == "model" and r["lenience"] == 1.0:
            by_t.setdefault((r["temperature"], r["top_k"], r["top_p"]), []).append(r)
    for i, (key, rs) in enumerate(sorted(by_t.items())):
        rs = sorted(rs, key=lambda r: r["gamma"])
        color = f"C{i}"
        gs = [r["gamma"] for r in rs]
        ax.errorbar(gs, [r["speedup"] for r in rs],
                    yerr=[[max(0.0, r["speedup"] - r["speedup_iqr"][0]) if r["speedup_iqr"][0] == r["speedup_iqr"][0] else 0 for r in rs],
                          [max(0.0, r["speedup_iqr"][1] - r["speedup"]) if r["speedup_iqr"][1] == r["speedup_iqr"][1] else 0 for r in rs]],
                    fmt="o-", color=color, label=f"measured T={key[0]:g}")
        a = sum(r["alpha"] for r in rs) / len(rs)
        # the paper's c (a draft step over a plain target step), as the table's Thm3.8 takes it
        c = sum(theory.paper_c(r["c"], r.get("verify_cost_steps", float("nan"))) for r in rs) / len(rs)
        if 0 <= a <= 1 and c == c:
            grid = list(range(1, max(gs) + 1))
            ax.plot(grid, [theory.speedup(a, g, c) for g in grid], "--", color=color,
                    label=f"Thm 3.8 (alpha={a:.2f}, c={c:.3f})")
    ax.axhline(1.0, color="gray", lw=0.8)
    written.append(_finish(plt, fig, ax, "gamma (draft tokens per round)", "speedup over plain decoding",
                           "Speculative vs plain decoding (medians, IQR bars)", out_dir / PLOT_FILES[0], 8))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    shown = [r for r in rows if r["accepted_hist"]][:6]
    width = 0.8 / max(1, len(shown))
    for i, r in enumerate(shown):
        h = r["accepted_hist"]
        total = sum(h) or 1
        ax.bar([n + i * width for n in range(len(h))], [k / total for k in h], width=width, label=r["setting"])
    written.append(_finish(plt, fig, ax, "drafts kept in a round", "fraction of rounds",
                           "Accepted-length histogram", out_dir / PLOT_FILES[1], 7))
    return written


def _finish(plt, fig, ax, xlabel: str, ylabel: str, title: str, path: Path, legend_size: int) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ax.get_legend_handles_labels()[0]:   # nothing labelled (one static gamma, ngram only): no legend
        ax.legend(fontsize=legend_size)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
