"""This checkout against another revision, the whole package, side by side on one bundle.

    python benchmarks/revision_ab.py BUNDLE --against HEAD~1 --temperature 1 --gamma 4 --repeats 12

policy_ab.py swaps the adaptive policy inside this checkout's loop; a change to the loop, the
sampler or the runtime needs the other revision's code whole. That revision is checked out into a
temporary git worktree (removed afterwards). Each repeat runs both sides, each in a fresh process
that imports edgespec from its own tree, loads the bundle (1 thread per model), warms up on three
prompts and then times the built-in code prompts; the order alternates between repeats, so a drift
of the host hits both sides alike, and the ratio is taken repeat by repeat. With a fixed gamma each
prompt is seeded alike on both sides (the same text wherever the two samplers agree). Adaptive
gamma at T > 0 runs unseeded (a seeded call prices calls from the bundle instead of measuring
them), so there each side samples its own text and the ratio is noisier.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from edgespec.cli import at_least
from edgespec.errors import InvalidArgumentError
from edgespec.generate_cli import parse_gamma

ROOT = Path(__file__).resolve().parents[1]

# One side of one repeat: argv = tree, bundle, temperature, gamma ("auto" or an int), repeat, tokens.
# Prints {"tokens": ..., "seconds": ...} (the calls' own GenerationStats, prefill included).
_SIDE = r"""
import importlib.util, json, os, sys
tree, bundle, temperature, gamma, rep, tokens = sys.argv[1:7]
# The package's folders as pyproject.toml maps them (edgespec.export is export/, edgespec.runtimes is
# runtimes/), looked up in this tree before any installed copy: an editable install maps those
# subpackages to its own checkout, which a path entry alone does not override.
FOLDERS = {"edgespec": "edgespec", "edgespec.export": "export", "edgespec.runtimes": "runtimes"}
class Tree:
    @staticmethod
    def find_spec(name, path=None, target=None):
        folder = os.path.join(tree, FOLDERS.get(name, ""))
        if name not in FOLDERS or not os.path.isfile(os.path.join(folder, "__init__.py")):
            return None
        return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])
sys.meta_path.insert(0, Tree)
sys.path.insert(0, tree)
import edgespec, edgespec.export, edgespec.runtimes
from edgespec.prompts import CODE_PROMPTS
for mod in (edgespec, edgespec.export, edgespec.runtimes):
    if not mod.__file__.startswith(tree):
        sys.exit(f"imported {mod.__name__} from {mod.__file__}, not from {tree}")
T, G, rep, tokens = float(temperature), None if gamma == "auto" else int(gamma), int(rep), int(tokens)
seeded = G is not None or T == 0
eng = edgespec.load(bundle, threads=1, draft_threads=1)
for p in CODE_PROMPTS[:3]:
    eng.generate(p, max_new_tokens=min(tokens, 32), temperature=T, gamma=G)
n = s = 0
for i, p in enumerate(CODE_PROMPTS):
    out = eng.generate(p, max_new_tokens=tokens, temperature=T, gamma=G, seed=1000 * rep + i if seeded else None)
    n, s = n + out.stats.emitted, s + out.stats.total_s
print(json.dumps({"tokens": n, "seconds": s}))
"""


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def _side(tree: Path, bundle: str, temperature: float, gamma: str, rep: int, tokens: int) -> float:
    """Tokens per second of one side of one repeat, in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", _SIDE, str(tree), bundle, repr(temperature), gamma, str(rep),
                           str(tokens)], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
        raise InvalidArgumentError(f"the side in {tree} failed (exit {proc.returncode}):\n{tail}\n(a revision whose "
                                   "edgespec.load or generate takes other arguments cannot run here: give a later "
                                   "--against)")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    return row["tokens"] / row["seconds"]


def run(bundle: str, against: str, temperature: float, gamma: str, repeats: int, tokens: int) -> dict[str, list[float]]:
    """Per repeat: tokens/s of this checkout ("this") and of ``against`` ("other")."""
    from edgespec.bundle import load_bundle

    load_bundle(Path(bundle))  # a missing or broken bundle first, before a worktree is made
    try:
        commit = _git("rev-parse", "--verify", f"{against}^{{commit}}")
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (getattr(exc, "stderr", None) or str(exc)).strip()
        raise InvalidArgumentError(f"cannot resolve {against!r} with git ({detail}); give a revision of this "
                                   "repository, e.g. HEAD~1 or a commit (a shallow clone may lack it: git fetch "
                                   "--unshallow)") from None
    rates: dict[str, list[float]] = {"this": [], "other": []}
    with tempfile.TemporaryDirectory(prefix="edgespec-ab-") as tmp:
        tree = Path(tmp) / "tree"
        _git("worktree", "add", "--detach", str(tree), commit)
        try:
            sides = {"this": ROOT, "other": tree}
            for rep in range(repeats):
                for side in (("this", "other") if rep % 2 == 0 else ("other", "this")):
                    rates[side].append(_side(sides[side], bundle, temperature, gamma, rep, tokens))
                print(f"[revision_ab] repeat {rep + 1}/{repeats}", file=sys.stderr)
        finally:
            _git("worktree", "remove", "--force", str(tree))
    return rates


def temperature(text: str) -> float:
    """An argparse type: a finite temperature >= 0 (a usage error otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be finite and >= 0, got {text}")
    return value


def ab_parser(description: str, against: str, repeats: int) -> argparse.ArgumentParser:
    """The options this script and policy_ab.py share: the bundle, the other revision (``against``:
    its help), the temperature, the repeats (default ``repeats``) and the tokens per prompt."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("bundle")
    ap.add_argument("--against", default="HEAD", help=against)
    ap.add_argument("--temperature", type=temperature, default=1.0)
    ap.add_argument("--repeats", type=at_least(1), default=repeats)
    ap.add_argument("--max-new-tokens", type=at_least(1), default=96)
    return ap


def main(argv=None) -> int:
    ap = ab_parser(__doc__.split("\n\n")[0], "git revision run as the other side (default HEAD)", 12)
    ap.add_argument("--gamma", default="4", help="draft length, or 'auto' for adaptive gamma (default 4)")
    args = ap.parse_args(argv)
    try:
        gamma = parse_gamma(args.gamma)
    except InvalidArgumentError as exc:
        ap.error(str(exc))
    rates = run(args.bundle, args.against, args.temperature, "auto" if gamma is None else str(gamma), args.repeats,
                args.max_new_tokens)
    ratio = np.array(rates["this"]) / np.array(rates["other"])
    print(f"T={args.temperature:g}, gamma {args.gamma}, {args.repeats} repeats of the built-in code prompts x "
          f"{args.max_new_tokens} tokens, 1 thread per model, each side in a fresh process per repeat")
    for side in ("this", "other"):
        print(f"{side:>6}: tok/s {' '.join(f'{r:.0f}' for r in rates[side])} (median {np.median(rates[side]):.0f})")
    print(f"this / {args.against}: median {np.median(ratio):.3f} [IQR {np.percentile(ratio, 25):.3f}-"
          f"{np.percentile(ratio, 75):.3f}], min {ratio.min():.3f}, max {ratio.max():.3f}")
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "revision_ab.py"))
