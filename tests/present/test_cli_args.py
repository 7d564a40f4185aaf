"""vramlab.present.cli_args: every subcommand's options, the parser, and the way back from a namespace to its
command line; the flags that take what a page's control takes are declared once, by the calculator."""

import argparse

import pytest

from vramlab.present import calculators as C
from vramlab.present import cli_args as A


def test_a_namespace_gives_back_its_command_line():
    argv = ["context", "--model", "llama-3.2-1b", "--seq-len", "65536", "--cp", "8", "--gpu", "h100",
            "--method", "ulysses", "--fsdp"]
    ns = A.parser().parse_args(argv + ["--json"])
    back = A.argv_of(ns)
    assert A.parser().parse_args(back) == argparse.Namespace(**{**vars(ns), "json": False})
    other = argparse.Namespace(**{**vars(ns), "cp": 16, "fsdp": False})
    assert A.changed_flags(ns, other) == "--cp 16 (without --fsdp)"
    assert A.defaults("checkpoint", seq_len=8).precision == "bf16-mixed"


@pytest.mark.parametrize("command, flag, calc, name", [
    ("estimate", "attention", "training", "attention"), ("lora", "targets", "compression", "targets"),
    ("checkpoint", "precision", "checkpointing", "precision"), ("context", "method", "context", "method"),
    ("context", "precision", "context", "precision"), ("context", "recompute", "context", "recompute"),
    ("context", "loss", "context", "loss"), ("context", "link", "context", "link"),
    ("experts", "link", "experts", "link"), ("serve", "dtype", "serving", "dtype")])
def test_shared_flags_are_the_calculators_declaration(command, flag, calc, name):
    action = next(a for a in A.command_actions(command) if a.dest == flag)
    declared = next(i for i in C.get(calc).inputs if i.name == name)
    assert (action.default, tuple(action.choices)) == (declared.default, declared.choices)


def test_declared_takes_choices_only():
    with pytest.raises(TypeError, match="batch_size is a int input"):
        A.declared(C.get("training"), "batch_size")
