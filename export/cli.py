"""``edgespec export``: command-line front end of ``export_bundle``."""
from __future__ import annotations

import argparse

from edgespec.cli import folder
from edgespec.errors import InvalidArgumentError

from .quantize import QUANT_CHOICES

EPILOG = """\
examples:
  edgespec export --target ckpt/llama-1b --draft ckpt/llama-68m --out bundles/llama
  edgespec export --model ckpt/gpt2 --out bundles/gpt2            (single model: plain decoding only)
  edgespec export --target T --draft D --out B --quantize-draft int8

Precision: fp32 by default. --quantize int8 quantizes both models' MatMul and Gemm weights to int8;
--quantize-target / --quantize-draft set it per model and override --quantize. A draft gets ONNX
Runtime's dynamic quantization (activations quantized with one scale per call); a target gets
per-token int8 (MatMulInteger; each token's activations get their own scale, 7-bit weights one scale
per output column), because with one scale per call a position's logits would depend on the other
tokens verified with it. (A per-token int8 target still amplifies the attention kernel's width
noise: greedy near-ties can flip against plain decoding; see README.md.) fp16 export is not supported yet.
Graphs: Llama and GPT-2 decoders get edgespec's static-KV graph (KV written in place, so rolling back a rejected
draft copies nothing); other architectures are traced by optimum-onnx (--graph chooses).
Every model is validated against PyTorch (prefill, 1- and 4-token steps, a rejected round rewound
as the runtime does, then on to 64 positions or the model's limit; int8 also against the logits'
range); above tolerance the export fails and nothing is written.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    src = parser.add_argument_group("inputs (local Hugging Face folders: config.json, *.safetensors, tokenizer.json)")
    src.add_argument("--target", metavar="DIR", help="target (large) model checkpoint folder")
    src.add_argument("--draft", metavar="DIR", help="draft (small) model checkpoint folder; same tokenizer as the target")
    src.add_argument("--model", metavar="DIR", help="single model (no draft): same as --target without --draft")
    parser.add_argument("--out", type=folder, required=True, metavar="BUNDLE", help="bundle folder to write (must not exist or be empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier bundle at --out (only a bundle that holds nothing else)")
    parser.add_argument("--quantize", choices=QUANT_CHOICES, default="none", help="precision change for both models (default: none = fp32)")
    parser.add_argument("--quantize-target", choices=QUANT_CHOICES, default=None, help="override --quantize for the target")
    parser.add_argument("--quantize-draft", choices=QUANT_CHOICES, default=None, help="override --quantize for the draft")
    parser.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32", help="export dtype (fp16 not supported yet)")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset of optimum graphs (default: optimum's choice for the architecture)")
    parser.add_argument("--graph", choices=("auto", "static", "optimum"), default="auto",
                        help="decoder graph: static = edgespec's Llama/GPT-2 graph with an in-place KV cache (zero-copy "
                             "rollback, fewer nodes); optimum = the traced graph (KV concat); auto (default) = static "
                             "where the architecture has one, else optimum")
    parser.add_argument("--atol", type=float, default=None, help="validation tolerance, fp32 graphs (default 1e-3)")
    parser.add_argument("--quantized-atol", type=float, default=None, help="validation tolerance, int8 graphs (default 1.0)")
    parser.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--format", choices=("onnx", "onnx+xla"), default="onnx",
                        help="onnx (default), or onnx+xla to also write jax.export artifacts for the XLA runtime "
                             "(needs the xla extra: pip install 'edgespec[xla]')")
    from .xla import add_xla_arguments

    add_xla_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from .pipeline import DEFAULT_ATOL, DEFAULT_QUANTIZED_ATOL, ExportOptions, _stderr_progress, export_bundle

    if args.model and (args.target or args.draft):
        raise InvalidArgumentError("use either --model DIR (single model) or --target DIR [--draft DIR], not both")
    target = args.model or args.target
    if not target and args.draft:
        raise InvalidArgumentError("--draft DIR needs the target it drafts for: add --target DIR (a draft alone "
                                   "exports as a single model with --model DIR)")
    if not target:
        raise InvalidArgumentError("nothing to export: pass --target DIR (and --draft DIR), or --model DIR")
    if args.quantize_draft is not None and not args.draft:
        raise InvalidArgumentError("--quantize-draft: this export has no draft (no --draft DIR); drop it, or quantize "
                                   "the model with --quantize-target / --quantize")
    if args.quantize != "none" and args.quantize_target is not None and (args.quantize_draft is not None or not args.draft):
        raise InvalidArgumentError(f"--quantize {args.quantize} does nothing here: --quantize-target overrides it for the "
                                   + ("target and --quantize-draft for the draft" if args.draft else "model (there is no draft)")
                                   + "; drop --quantize")
    options = ExportOptions(
        quantize_target=args.quantize_target or args.quantize,
        quantize_draft=(args.quantize_draft or args.quantize) if args.draft else "none",
        dtype=args.dtype,
        opset=args.opset,
        atol=DEFAULT_ATOL if args.atol is None else args.atol,
        quantized_atol=DEFAULT_QUANTIZED_ATOL if args.quantized_atol is None else args.quantized_atol,
        overwrite=args.overwrite,
        graph=args.graph,
    )
    xla = None
    if "xla" not in args.format:
        given = [f for f, v in (("--platforms", args.platforms is not None),
                                ("--max-length", args.max_length is not None),
                                ("--verify-width", args.verify_width is not None),
                                ("--prefill-buckets", args.prefill_buckets is not None),
                                ("--max-source-length", args.max_source_length is not None)) if v]
        if given:
            verb, it = ("applies", "it") if len(given) == 1 else ("apply", "them")
            raise InvalidArgumentError(f"{', '.join(given)} only {verb} to XLA artifacts; add --format onnx+xla or drop {it}")
    else:
        try:
            import jax  # noqa: F401
        except ImportError:
            raise InvalidArgumentError("--format onnx+xla needs JAX: pip install 'edgespec[xla]'") from None
        vw = args.verify_width if args.verify_width is not None else 9
        xla = dict(platforms=args.platforms or ["cpu"], max_length=args.max_length,
                   verify_width=vw, prefill_buckets=args.prefill_buckets, max_source_length=args.max_source_length)
    manifest = export_bundle(target, args.out, draft=args.draft, options=options,
                             progress=None if args.quiet else _stderr_progress, xla=xla)
    # the XLA artifacts are fp32 whatever the ONNX graphs' precision
    roles = ", ".join(f"{r}={m.architecture} ({m.dtype if m.quantization == 'none' else m.quantization}"
                      f"{'; XLA fp32' if xla is not None and (m.quantization != 'none' or m.dtype != 'fp32') else ''})"
                      for r, m in manifest.models.items())
    # generation samples from the tokenizer's ids; embedding rows beyond them are padding
    vocab = f"; {manifest.sample_vocab_size} token ids"
    if any(m.vocab_size != manifest.sample_vocab_size for m in manifest.models.values()):
        vocab += " (embedding rows: " + ", ".join(f"{r} {m.vocab_size}" for r, m in manifest.models.items()) + ")"
    print(f"wrote bundle {args.out}: {roles}{vocab}")
    return 0
