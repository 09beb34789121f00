"""`k3post transplant OUT_DIR`: give a model a new tokenizer (docs/transplant.md).

    k3post transplant runs/smol-12k                                    # SmolLM2 + a 12k BPE of the built-in corpus
    k3post transplant runs/smol-8k --vocab-size 8000 --corpus a.txt b.txt
    k3post transplant runs/smol-24 --keep-layers 0-11,18-29           # a 24-layer pruned student
    k3post transplant runs/onto --base /models/m --tokenizer /tokenizers/t

The output is an ordinary HF directory (`path:` in a recipe); a recipe can also name the same
model as `transplant: {...}` and have it built once into the k3post cache.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from k3post.config.errors import UserError, located

DEFAULT_BASE = "builtin:smollm2-135m-instruct"


def add_transplant(sub) -> None:
    parser = sub.add_parser(
        "transplant", help="give a model a new tokenizer: embeddings = means of the old tokens' embeddings",
        description="Write OUT_DIR, an HF model directory: the base model's body under a new tokenizer (a\n"
                    "byte-level BPE trained here, or --tokenizer). Each new token's embedding is the mean of the\n"
                    "base's embeddings of that token's text as the base's tokenizer splits it; the tied output\n"
                    "head is the same matrix, or with --head chain a head of its own that keeps the base's\n"
                    "next-token probabilities. docs/transplant.md explains the maths and the cost.",
        epilog="examples:\n  k3post transplant runs/smol-12k\n"
               "  k3post transplant runs/smol-24 --keep-layers 0-11,18-29 --vocab-size 16000 --head chain\n"
               "  k3post transplant runs/mine --base /models/m --corpus notes.txt book.txt",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, metavar="OUT_DIR", help="output directory (new, or empty)")
    parser.add_argument("--base", default=DEFAULT_BASE,
                        help="the model whose body is kept: builtin:NAME, a GGUF file or an HF directory "
                             "(default: %(default)s); it must tie its embedding and head")
    parser.add_argument("--keep-layers", metavar="I,J,A-B",
                        help="keep only these decoder layers of the base, in order, e.g. 0-11,18-29")
    parser.add_argument("--tokenizer", metavar="DIR", help="transplant onto this tokenizer (an HF directory with a "
                                                           "fast tokenizer) instead of training one")
    parser.add_argument("--vocab-size", type=int, metavar="N",
                        help="vocabulary of the trained tokenizer (default 12000)")
    parser.add_argument("--corpus", nargs="+", action="extend", metavar="FILE",
                        help="UTF-8 text files to train on (default: the built-in corpus of Python's help topics "
                             "and standard-library docstrings)")
    parser.add_argument("--head", choices=("tied", "chain"), default="tied",
                        help="tied: the head is the new embedding (each logit the mean of the pieces'); chain: a head "
                             "of its own, the first piece's old logit plus the old log-probability of the rest "
                             "(untied; recommended: docs/transplant.md) (default: %(default)s)")


def parse_layers(text: str) -> list[int]:
    """`0,1,5-7` -> [0, 1, 5, 6, 7]."""
    layers = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise UserError(f"--keep-layers {text!r}: expected layer indices and ranges such as 0,1,5-7")
        layers.extend(range(int(first), int(last) + 1) if dash else [int(first)])
    return layers


def base_spec(base: str, keep_layers: str | None) -> dict:
    """--base (builtin:NAME | FILE.gguf | DIR) and --keep-layers as a ModelSpec's fields."""
    if base.startswith("builtin:"):
        spec = {"builtin": base.removeprefix("builtin:")}
    elif base.endswith(".gguf"):
        spec = {"gguf": str(Path(base).resolve())}
    else:
        spec = {"path": str(Path(base).resolve())}
    if keep_layers is not None:
        spec["keep_layers"] = parse_layers(keep_layers)
    return spec


def transplant_spec(args: argparse.Namespace):
    """The TransplantSpec the command line describes; schema errors named by their option."""
    from k3post.config.model_schema import TransplantSpec  # noqa: PLC0415

    if args.tokenizer is not None and (args.vocab_size is not None or args.corpus):
        raise UserError("--tokenizer transplants onto a given tokenizer; --vocab-size and --corpus train one: "
                        "give one or the other")
    fields = {"base": base_spec(args.base, args.keep_layers), "head": args.head}
    if args.tokenizer is not None:
        fields["tokenizer"] = str(Path(args.tokenizer).resolve())
    if args.vocab_size is not None:
        fields["vocab_size"] = args.vocab_size
    if args.corpus:
        fields["corpus"] = [str(Path(p).resolve()) for p in args.corpus]
    try:
        return TransplantSpec(**fields)
    except ValidationError as err:
        options = {"base": "--base/--keep-layers", "vocab_size": "--vocab-size", "tokenizer": "--tokenizer"}
        problems = [f"{options.get(str(e['loc'][0]), str(e['loc'][0])) if e['loc'] else 'transplant'}: {e['msg']}"
                    for e in err.errors()]
        raise UserError("; ".join(problems)) from None


def check_output(out: Path) -> None:
    """OUT_DIR is a new directory, or an empty one."""
    for path in (out, *out.parents):
        if path.exists() and not path.is_dir():
            raise UserError(located(out, "OUT_DIR is a file, or inside one; expected a new directory"))
    if out.is_dir() and any(out.iterdir()):
        raise UserError(located(out, "OUT_DIR exists and is not empty; give a new directory (or remove this one)"))


def cmd_transplant(args: argparse.Namespace) -> int:
    from k3post.model.tokenizers.corpus import read_corpus  # noqa: PLC0415
    from k3post.model.tokenizers.transplant import base_name, build_transplanted  # noqa: PLC0415
    from k3post.track.atomic import atomic_directory  # noqa: PLC0415

    spec = transplant_spec(args)
    check_output(args.out)
    if spec.corpus is not None:
        read_corpus(spec.corpus)  # a missing or binary corpus file fails before the model loads

    def progress(message: str) -> None:
        print(f"k3post: {message}", file=sys.stderr, flush=True)

    progress(f"transplanting {base_name(spec.base)}"
             f"{f' ({len(spec.base.keep_layers)} layers kept)' if spec.base.keep_layers else ''}")
    with atomic_directory(args.out) as tmp:
        report = build_transplanted(spec, tmp, progress=progress)
    print(f"k3post: {report.line(args.out)}")
    return 0
