"""Model-free count drafts for the paper's Table 3 baselines: unigram and bigram models estimated
from token counts of the training corpus, run through the same Backend protocol (edgespec.toy)."""
from __future__ import annotations

import numpy as np

from edgespec.toy import ToyBackend, ToyLM


def count_tables(token_docs: list[list[int]], vocab: int, smoothing: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """log-probability tables: unigram [1, V] and bigram [V, V] (row = previous token)."""
    uni = np.full(vocab, smoothing)
    bi = np.full((vocab, vocab), smoothing, dtype=np.float64)
    for ids in token_docs:
        a = np.asarray(ids, dtype=np.int64)
        a = a[a < vocab]
        np.add.at(uni, a, 1.0)
        if a.size > 1:
            np.add.at(bi, (a[:-1], a[1:]), 1.0)
    uni = np.log(uni / uni.sum())[None, :]
    bi = np.log(bi / bi.sum(axis=1, keepdims=True))
    return uni.astype(np.float32), bi.astype(np.float32)


def count_backends(token_docs: list[list[int]], vocab: int, max_length: int) -> dict[str, ToyBackend]:
    uni, bi = count_tables(token_docs, vocab)
    return {"unigram": ToyBackend(ToyLM(vocab, 1, table=uni), max_length),
            "bigram": ToyBackend(ToyLM(vocab, 2, table=bi), max_length)}


if __name__ == "__main__":  # a library of paper_tables.py, not a script
    import sys

    print(__doc__.strip() + "\n\nA module used by benchmarks/paper_tables.py; run that script instead.", file=sys.stderr)
    sys.exit(0 if {"-h", "--help"} & set(sys.argv[1:]) else 2)
