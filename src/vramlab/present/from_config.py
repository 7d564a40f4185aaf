"""`vramlab estimate --from FILE`: the estimate of a training configuration the user already has.

`configs.read_setup` reads the file (DeepSpeed JSON, TrainingArguments JSON, accelerate config, Axolotl
YAML, torchtune recipe, torchtitan TOML); this prints every setting with the field it came from (or the
assumption made), one rank's peak, the equivalent library call, and with --gpu whether it fits.
Exit codes as `vramlab`'s: 0 success, 2 bad input (one line on stderr, never a traceback).

`--from` is an option of `vramlab estimate` (present/cli_args.py adds `add_file_options` to its parser and
calls `answer_from` when it is given); `main` is the same command on its own parser.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .. import checks, configs, specs
from ..units import fmt_bytes

PROG = "vramlab estimate --from"


def load_yaml(text: str):
    """PyYAML's safe_load, imported when a YAML is read; without PyYAML, one line saying so."""
    try:
        import yaml
    except ImportError:
        raise configs.ConfigError("reading a YAML config needs PyYAML: pip install pyyaml") from None
    return yaml.safe_load(text)


def read_setup(source, **options) -> configs.Setup:
    """`configs.read_setup` with PyYAML as its YAML parser: every format, from a path, a text or a dict."""
    return configs.read_setup(source, yaml_loader=load_yaml, **options)


def wants(argv: Sequence[str]) -> bool:
    """Does this `vramlab estimate ...` command line read a configuration file (--from FILE)?"""
    return any(a == "--from" or a.startswith("--from=") for a in argv)


# what `answer_from` reads of a parsed command line: the file, its format, and what fills in what it does not say
READS = ("from_file", "format", "model", "gpus", "batch_size", "seq_len", "gpu", "json")


def add_file_options(p, *, required: bool = True):
    """--from FILE and --format, on `p` (a parser or an argument group, returned)."""
    p.add_argument("--from", dest="from_file", required=required, metavar="FILE",
                   help="a training configuration: " + ", ".join(configs.FORMAT_NAMES.values()))
    p.add_argument("--format", default=None, choices=configs.FORMATS, help="the file's format (default: from its fields)")
    return p


def add_from_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `vramlab estimate --from FILE` (on `p`, returned)."""
    count = checks.argtype(checks.whole, int)
    add_file_options(p)
    p.add_argument("--model", default=None, metavar="MODEL",
                   help="a config.json (or its folder), a preset, or a Hugging Face id in the local cache "
                        "(default: the model the file names, where it names one)")
    p.add_argument("--gpus", type=count, default=None, help="data-parallel ranks, where the launcher says it")
    p.add_argument("--batch-size", type=count, default=None, help="the micro-batch, where the file does not say it")
    p.add_argument("--seq-len", type=count, default=None, help="tokens a sequence, where the file does not say it")
    p.add_argument("--gpu", default=None, help=f"check the fit on one of: {', '.join(specs.GPUS)}")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def build_parser() -> argparse.ArgumentParser:
    return add_from_options(checks.Parser(prog=PROG, description="One rank's peak memory for the training "
                                          "configuration you already have, with every setting's source."))


def answer_from(ns: argparse.Namespace) -> int:
    """Read, estimate, print; raises ValueError (one line) for what cannot be priced."""
    setup = read_setup(ns.from_file, fmt=ns.format, model=ns.model, gpus=ns.gpus, batch_size=ns.batch_size,
                               seq_len=ns.seq_len, gpu=ns.gpu)
    est = setup.estimate()
    fit = setup.fit() if setup.gpu else None
    if ns.json:
        out = {**setup.to_dict(), "total_bytes": est.total, "breakdown": est.to_dict(), "peak_phase": est.phase}
        if fit is not None:
            out["gpu"] = {"name": fit.gpu.name, "fits": fit.fits, "needed_bytes": fit.needed,
                          "usable_bytes": fit.available}
        print(json.dumps(out, indent=2))
        return 0
    print(setup.describe())
    print()
    print(est.table(title=f"one rank's peak: {setup.model.spec.name}, {fmt_bytes(est.total)}"))
    if fit is not None:
        print(fit)
        print(fit.explain())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`vramlab estimate --from FILE ...` (argv without `vramlab estimate`); returns the exit status."""
    ns = build_parser().parse_args(argv)
    try:
        return answer_from(ns)
    except (ValueError, KeyError) as e:  # ConfigError and SpecError are ValueErrors
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        print(f"vramlab: error: {' '.join(msg.split())}", file=sys.stderr)
        return 2
