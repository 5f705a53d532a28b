"""Side-by-side measurement of plain and speculative decoding: tokens/s medians over repeated,
interleaved runs, measured alpha and c, the Theorem 3.8 prediction, and the bytes each model
must read per generated token (section 3.4)."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from . import theory
from .adaptive import AdaptiveGamma
from .config import GenerationConfig, SamplingConfig
from .loop import GenerationStats, generate


class ReadCounter:
    """A Backend proxy that counts the bytes a forward call must read from memory: every
    weight once per call, plus the KV cache already held (its real length at that call; with
    ``static_positions``, that many: XLA's artifacts attend over their whole buffer, masked). An
    encoder-decoder's decoder call also reads the cross-attention KV of the prompt (with
    ``static_positions``, of the whole encoder length, ``max_prompt_length``).
    Per token, plain decoding pays this once per token; speculation once per round."""

    def __init__(self, backend, weight_bytes: int, kv_bytes_per_token: int, static_positions: int | None = None):
        self.backend = backend
        self.vocab_size, self.max_length = backend.vocab_size, backend.max_length
        for name in ("is_encoder_decoder", "verify_width", "max_prompt_length"):  # the loop and drafters read them
            if hasattr(backend, name):
                setattr(self, name, getattr(backend, name))
        self.weight_bytes, self.kv_bytes_per_token = weight_bytes, kv_bytes_per_token
        self.static_positions = static_positions  # attention over the whole buffer at every call (XLA)
        self._cross = 0                           # encoder positions each decoder call attends to
        self.reset()

    def reset(self) -> None:
        self.calls = self.weight_read = self.kv_read = 0

    @property
    def length(self) -> int:
        return self.backend.length

    def _count(self, past: int) -> None:
        self.calls += 1
        self.weight_read += self.weight_bytes
        self.kv_read += self.kv_bytes_per_token * ((past if self.static_positions is None else self.static_positions)
                                                   + self._cross)

    def prefill(self, ids):
        if getattr(self, "is_encoder_decoder", False):
            self._cross = self.max_prompt_length if self.static_positions else np.asarray(ids).size
        self._count(0)
        return self.backend.prefill(ids)

    def extend(self, ids):
        self._count(self.backend.length)
        return self.backend.extend(ids)

    def rewind_to(self, n: int) -> None:
        self.backend.rewind_to(n)

    def free(self) -> None:
        self.backend.free()


@dataclass(frozen=True)
class Setting:
    """One cell of the benchmark grid. gamma None = adaptive; draft 'model' or 'ngram'."""

    gamma: int | None
    sampling: SamplingConfig
    lenience: float = 1.0
    draft: str = "model"

    @property
    def label(self) -> str:
        s = self.sampling
        g = "auto" if self.gamma is None else str(self.gamma)
        extra = (f" top_k={s.top_k}" if s.top_k else "") + (f" top_p={s.top_p}" if s.top_p < 1 else "")
        extra += f" l={self.lenience}" if self.lenience < 1 else ""
        return f"{self.draft} gamma={g} T={s.temperature:g}{extra}"


@dataclass
class SettingResult:
    setting: Setting
    plain_tps: list[float] = field(default_factory=list)      # per repeat: tokens/s over all prompts
    spec_tps: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)         # per repeat: spec / plain, same run
    plain_ttft: list[float] = field(default_factory=list)
    spec_ttft: list[float] = field(default_factory=list)
    # Decode rate (1 / time per output token after the first): the target's prefill and the first
    # token are the same work with or without a draft (the loop prefills the draft after the first
    # token), so this is the part speculation can speed up; the draft's prefill is in it.
    plain_decode_tps: list[float] = field(default_factory=list)  # per repeat: (tokens - 1) / (s - ttft)
    spec_decode_tps: list[float] = field(default_factory=list)
    decode_ratios: list[float] = field(default_factory=list)     # per repeat: spec / plain decode rate
    stats: list[GenerationStats] = field(default_factory=list)  # speculative runs, warm-up excluded
    plain_step: list[float] = field(default_factory=lambda: [0.0, 0])  # plain runs: target step seconds, steps
    reads: dict = field(default_factory=dict)

    def summary(self) -> dict:
        beta_sum = sum(s.beta_sum for s in self.stats)
        beta_n = sum(s.beta_count for s in self.stats)
        alpha = beta_sum / beta_n if beta_n else float("nan")
        draft_calls = sum(s.draft_calls for s in self.stats)
        # the verify calls only (prefill and plain steps inside the runs excluded), for c and V
        verify = [s.verify for s in self.stats]
        target_s, steps = sum(v[0] for v in verify), sum(v[1] for v in verify)
        draft_s = sum(s.draft_s for s in self.stats)
        c = (draft_s / draft_calls) / (target_s / steps) if draft_calls and steps and target_s > 0 else float("nan")
        # lenience < 1 (Appendix A.5): the test keeps more than min(p, q), so the theory columns take
        # the mean keep probability; alpha stays the paper's E[sum min(p, q)]
        alpha_test = sum(s.keep_sum for s in self.stats) / beta_n if beta_n else float("nan")
        rounds = sum(s.rounds for s in self.stats)
        drafted = sum(s.drafted for s in self.stats)
        mean_gamma = drafted / rounds if rounds else float("nan")
        # tokens committed by plain target steps: a run's last token (no room for a draft), lookups
        # that found nothing, and those the adaptive policy found faster than drafted rounds
        emitted = sum(s.emitted for s in self.stats)
        plain = sum(s.plain_steps for s in self.stats)
        plain_share = plain / emitted if emitted else float("nan")
        declined, empty = sum(s.declined_steps for s in self.stats), sum(s.empty_drafts for s in self.stats)
        no_room = plain - declined - empty
        causes = {k: n / emitted if emitted else float("nan") for k, n in
                  (("adaptive_policy", declined), ("nothing_drafted", empty), ("no_room", no_room))}
        hist: list[int] = []
        for s in self.stats:
            for n, k in enumerate(s.accepted_hist):
                hist.extend([0] * (n + 1 - len(hist)))
                hist[n] += k
        tokens_per_round = sum(s.round_tokens for s in self.stats) / rounds if rounds else float("nan")
        # The theory columns take each round with the gamma it drafted (gamma_hist): adaptive gamma
        # and prompt lookup (which proposes what it finds) vary it, and a static gamma drafts fewer
        # where the tokens left to generate cap a round. Expected tokens per round is the mean of
        # Equation 1 over the rounds, and Theorem 3.8 their expected tokens over their expected cost,
        # sum E(g) / sum (g c + 1): the mean gamma put into the formulas is not the same (E is concave).
        counts = [0] * max((len(s.gamma_hist) for s in self.stats), default=0)
        for s in self.stats:
            for g, n in enumerate(s.gamma_hist):
                counts[g] += n
        if not any(counts):  # no drafted round: the setting's gamma (nothing was measured to weigh it)
            counts = [0] * (self.setting.gamma or 1) + [1]
        # (a sum of rounded terms can pass 1 by an ulp where q <= p / l everywhere: it is at most 1)
        a = min(alpha_test, 1.0) if self.setting.lenience < 1 else alpha
        ok = 0 <= a <= 1 and c == c
        # Theorem 3.8 assumes a verify call of g + 1 tokens costs one target step. V is what it
        # cost here (mean verify call / mean plain step, both measured in this run). The theorem's c
        # is a draft step over a target step, here a plain one: c V (c, the column, is over a verify
        # call), so Theorem 3.8 as stated is E / (g c V + 1), as `edgespec plan` computes it from the
        # paper's c. With the measured verify cost a round takes (g c + 1) verify calls, (g c + 1) V
        # plain steps: E / ((g c + 1) V). What the run still misses against that is sampling, Python
        # and prefill time.
        plain_s, plain_n = self.plain_step
        v = (target_s / steps) / (plain_s / plain_n) if steps and target_s > 0 and plain_n and plain_s > 0 \
            else float("nan")
        if ok:
            expected = sum(n * theory.expected_tokens(a, g) for g, n in enumerate(counts)) / sum(counts)
            paper_c = theory.paper_c(c, v)
            predicted = expected * sum(counts) / sum(n * (g * paper_c + 1) for g, n in enumerate(counts))
            with_v = expected * sum(counts) / sum(n * (g * c + 1) * v for g, n in enumerate(counts))
        else:
            expected = predicted = with_v = float("nan")
        return {
            "setting": self.setting.label,
            "gamma": self.setting.gamma, "mean_gamma": mean_gamma,
            "temperature": self.setting.sampling.temperature, "top_k": self.setting.sampling.top_k,
            "top_p": self.setting.sampling.top_p, "lenience": self.setting.lenience, "draft": self.setting.draft,
            "plain_step_share": plain_share,
            "plain_step_causes": causes,  # shares of the tokens, summing to plain_step_share
            "alpha": alpha, "acceptance_rate": sum(s.accepted for s in self.stats) / beta_n if beta_n else float("nan"),
            "c": c,
            "tokens_per_round": tokens_per_round,
            "expected_tokens_per_round": expected,
            "keep_probability": alpha_test,
            "accepted_hist": hist,
            "plain_tokens_per_s": _med(self.plain_tps), "spec_tokens_per_s": _med(self.spec_tps),
            "plain_tokens_per_s_all": self.plain_tps, "spec_tokens_per_s_all": self.spec_tps,
            "speedup": _med(self.ratios), "speedup_all": self.ratios,
            "speedup_iqr": _iqr(self.ratios),
            "predicted_speedup": predicted,
            "verify_cost_steps": v,
            "predicted_speedup_verify_cost": with_v,
            "plain_ttft_s": _med(self.plain_ttft), "spec_ttft_s": _med(self.spec_ttft),
            "plain_decode_tokens_per_s": _med(self.plain_decode_tps),
            "spec_decode_tokens_per_s": _med(self.spec_decode_tps),
            "decode_speedup": _med(self.decode_ratios), "decode_speedup_all": self.decode_ratios,
            "decode_speedup_iqr": _iqr(self.decode_ratios),
            **self.reads,
        }


def _decode_rate(total: list) -> float:
    """Tokens after the first per second after the first: [tokens, seconds, ttft, first tokens]."""
    tokens, seconds, ttft, firsts = total
    return (tokens - firsts) / (seconds - ttft) if seconds > ttft and tokens > firsts else float("nan")


def _finite(xs: Sequence[float]) -> list[float]:
    """The repeats that have the quantity (a repeat whose outputs all stop at their first token
    has no decode rate): a NaN would make a sorted statistic depend on the list's order."""
    return [x for x in xs if math.isfinite(x)]


def _med(xs: Sequence[float]) -> float:
    xs = _finite(xs)
    return statistics.median(xs) if xs else float("nan")


def _iqr(xs: Sequence[float]) -> list[float]:
    xs = _finite(xs)
    if len(xs) < 2:
        return [float("nan"), float("nan")]
    q = statistics.quantiles(xs, n=4, method="inclusive")  # within the data ("exclusive" extrapolates)
    return [q[0], q[2]]


def run_setting(target: ReadCounter, draft: ReadCounter | None, prompts: Sequence[Sequence[int]],
                setting: Setting, max_new_tokens: int, repeats: int, warmup: int = 1,
                eos_token_ids: tuple[int, ...] = (), seed: int = 0,
                progress: Callable[[str], None] | None = None, vocab_size: int | None = None) -> SettingResult:
    """One setting: plain and speculative runs of every prompt interleaved (see run_settings)."""
    return run_settings(target, draft, prompts, [setting], max_new_tokens, repeats, warmup, eos_token_ids, seed,
                        progress, vocab_size)[0]


def run_settings(target: ReadCounter, draft: ReadCounter | None, prompts: Sequence[Sequence[int]],
                 settings: Sequence[Setting], max_new_tokens: int, repeats: int, warmup: int = 1,
                 eos_token_ids: tuple[int, ...] = (), seed: int = 0,
                 progress: Callable[[str], None] | None = None, vocab_size: int | None = None,
                 max_gamma: int = 8) -> list[SettingResult]:
    """Measure settings side by side, ``warmup`` repeats discarded. Settings that sample alike
    run together: for every prompt, one plain run and every setting's speculative run back to back
    (same seed; the order rotates from prompt to prompt), so a drift in the host's speed hits plain
    decoding and every setting alike, and settings can be compared with each other, not only with
    plain decoding. The plain run is shared: every setting of the group gets the same plain tokens/s.
    ``max_gamma``: the adaptive policy's bound (the verify width - 1 of XLA artifacts at most)."""
    results = [SettingResult(s) for s in settings]
    groups: dict[SamplingConfig, list[int]] = {}
    for j, s in enumerate(settings):
        groups.setdefault(s.sampling, []).append(j)
    for sampling, members in groups.items():
        _run_group(target, draft, prompts, [results[j] for j in members], max_new_tokens, repeats, warmup,
                   eos_token_ids, seed, progress, vocab_size, max_gamma)
    return results


def _run_group(target, draft, prompts, results: list[SettingResult], max_new_tokens, repeats, warmup,
               eos_token_ids, seed, progress, vocab_size, max_gamma) -> None:
    from .drafters import HybridDrafter, LookaheadDrafter, NgramDrafter

    cfgs = [GenerationConfig(max_new_tokens=max_new_tokens, sampling=r.setting.sampling, gamma=r.setting.gamma,
                             lenience=r.setting.lenience, eos_token_ids=eos_token_ids,
                             max_gamma=max(max_gamma, r.setting.gamma or 0), vocab_size=vocab_size) for r in results]
    # One adaptive policy per setting for the whole run, as an Engine keeps one across calls: the
    # warm-up repeat is also its first lesson.
    policies = [AdaptiveGamma(c.max_gamma) if r.setting.gamma is None else None for r, c in zip(results, cfgs)]
    make = {"ngram": lambda: NgramDrafter(), "lookahead": lambda: LookaheadDrafter(draft),
            "hybrid": lambda: HybridDrafter(draft), "model": lambda: draft}
    drafters = [make[r.setting.draft]() for r in results]
    modes = [-1, *range(len(results))]  # -1: plain decoding
    plain_step = [0.0, 0]
    plain_reads = [0, 0]                             # target bytes, tokens
    spec_reads = [[0, 0, 0] for _ in results]        # target bytes, draft bytes, tokens
    plain_tps, plain_ttft, plain_dec = [], [], []
    label = results[0].setting.label if len(results) == 1 else f"T={results[0].setting.sampling.temperature:g}, {len(results)} settings"
    for rep in range(warmup + repeats):
        keep = rep >= warmup
        totals = {m: [0, 0.0, 0.0, 0] for m in modes}  # tokens, seconds, ttft, first tokens
        for i, prompt in enumerate(prompts):
            turn = (rep * len(prompts) + i) % len(modes)
            for m in modes[turn:] + modes[:turn]:
                rng = np.random.default_rng(seed + 1000 * rep + i)
                target.reset()
                if draft is not None:
                    draft.reset()
                t0 = time.perf_counter()
                r = generate(target, prompt, cfgs[max(m, 0)], rng, None if m < 0 else drafters[m],
                             policy=None if m < 0 else policies[m])
                dt = time.perf_counter() - t0
                tot = totals[m]
                tot[0] += len(r.tokens)
                tot[1] += dt
                tot[2] += r.stats.ttft_s
                tot[3] += min(1, len(r.tokens))
                if not keep:
                    continue
                if m < 0:
                    plain_reads[0] += target.weight_read + target.kv_read
                    plain_reads[1] += len(r.tokens)
                    plain_step[0] += r.stats.target_s
                    plain_step[1] += r.stats.target_calls - 1  # the prefill is not a step
                else:
                    results[m].stats.append(r.stats)
                    reads = spec_reads[m]
                    reads[0] += target.weight_read + target.kv_read
                    reads[1] += (draft.weight_read + draft.kv_read) if results[m].setting.draft != "ngram" and draft else 0
                    reads[2] += len(r.tokens)
        if keep:
            p_tps = totals[-1][0] / totals[-1][1]
            plain_tps.append(p_tps)
            plain_ttft.append(totals[-1][2] / len(prompts))
            p_dec = _decode_rate(totals[-1])
            plain_dec.append(p_dec)
            for m, res in enumerate(results):
                s_tps = totals[m][0] / totals[m][1]
                res.spec_tps.append(s_tps)
                res.ratios.append(s_tps / p_tps)
                res.spec_ttft.append(totals[m][2] / len(prompts))
                s_dec = _decode_rate(totals[m])
                res.spec_decode_tps.append(s_dec)
                res.decode_ratios.append(s_dec / p_dec if p_dec > 0 else float("nan"))
        if progress is not None:
            progress(f"{label}: repeat {rep + 1}/{warmup + repeats}" + ("" if keep else " (warm-up)"))
    for res, (t_bytes, d_bytes, n) in zip(results, spec_reads):
        res.plain_tps, res.plain_ttft, res.plain_step = list(plain_tps), list(plain_ttft), list(plain_step)
        res.plain_decode_tps = list(plain_dec)
        if plain_reads[1] and n:
            t_plain, t_spec, d_spec = plain_reads[0] / plain_reads[1], t_bytes / n, d_bytes / n
            res.reads = {
                "target_bytes_per_token_plain": t_plain,
                "target_bytes_per_token_spec": t_spec,
                "draft_bytes_per_token_spec": d_spec,
                "target_read_reduction": t_plain / t_spec if t_spec else float("nan"),
                "total_read_reduction": t_plain / (t_spec + d_spec) if t_spec + d_spec else float("nan"),
            }


def adaptive_vs_static(results: Sequence[SettingResult]) -> list[dict]:
    """Per group of settings measured together (same sampling, lenience and drafter): adaptive
    gamma's speculative tokens/s over the best static gamma's, repeat by repeat (both from the same
    interleaved run). The best static gamma is picked on the same repeats, which favours it."""
    out = []
    groups: dict[tuple, list[SettingResult]] = {}
    for r in results:
        s = r.setting
        groups.setdefault((s.sampling, s.lenience, s.draft), []).append(r)
    for (sampling, lenience, kind), rs in groups.items():
        auto = [r for r in rs if r.setting.gamma is None]
        static = [r for r in rs if r.setting.gamma is not None and r.spec_tps]
        if not auto or not static or not auto[0].spec_tps:
            continue
        best = max(static, key=lambda r: _med(r.spec_tps))
        ratios = [a / b for a, b in zip(auto[0].spec_tps, best.spec_tps)]
        out.append({"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                    "lenience": lenience, "draft": kind, "best_static_gamma": best.setting.gamma,
                    "adaptive_over_best_static": _med(ratios), "iqr": _iqr(ratios), "all": ratios})
    return out


def hardware_counters_note() -> str:
    """Whether `perf stat` can measure memory traffic here; the bench prints this line."""
    import shutil
    import subprocess

    if shutil.which("perf") is None:
        return "hardware counters: `perf` is not installed; bytes are counted from the bundle, not measured"
    try:
        proc = subprocess.run(["perf", "stat", "-x,", "-e", "cache-misses", "true"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"hardware counters: perf failed ({exc}); bytes are counted from the bundle, not measured"
    out = proc.stderr
    if "not supported" in out or "<not" in out:
        return "hardware counters: not exposed on this machine (perf reports <not supported>); bytes are counted, not measured"
    counted = any(line.split(",")[0].strip().isdigit() and "cache-misses" in line for line in out.splitlines())
    if proc.returncode != 0 or not counted:  # e.g. a distribution's wrapper without perf for this kernel
        last = (out.strip().splitlines() or ["no output"])[-1][:120]
        return f"hardware counters: perf does not work here ({last}); bytes are counted from the bundle, not measured"
    return "hardware counters: available (perf stat -e cache-misses works); run the bench under perf for a measured figure"
