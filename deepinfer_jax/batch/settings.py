"""Engine settings on the command line: one ``--field-name VALUE`` option per ``EngineConfig`` field.

The value is parsed by the field's declared type: ``int``, ``bool`` (true/false, yes/no, 1/0),
``str``, ``tuple[int, ...]`` (comma-separated, e.g. ``--token-buckets 32,64``), and ``none`` for an
optional field; ``compilation_cache`` also takes ``off``. A value of the wrong type is an argparse
error naming the option; a value of the right type that ``EngineConfig`` refuses (e.g.
``--max-num-seqs 0``) is its ``ValueError`` naming the field, raised by ``engine_settings``.
"""

from __future__ import annotations

import argparse

from deepinfer_jax.config import EngineConfig

__all__ = ["add_engine_options", "engine_settings"]

_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _bool(text: str) -> bool:
    try:
        return _BOOLS[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}") from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _optional(parse):
    def convert(text: str):
        return None if text.strip().lower() in ("none", "null") else parse(text)
    convert.__name__ = parse.__name__
    return convert


def _converter(name: str, annotation: str):
    base = annotation.replace(" | None", "").strip()
    parse = {"int": _int, "bool": _bool, "str": str, "tuple[int, ...]": _ints}.get(base, str)
    if name == "compilation_cache":
        return lambda text: False if text.strip().lower() in ("off", "false") else (
            None if text.strip().lower() == "none" else text)
    return _optional(parse) if "None" in annotation or base == "Any" else parse


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--max-num-seqs`` etc. (every ``EngineConfig`` field) to ``parser``, into ``dest`` ``engine.<field>``."""
    group = parser.add_argument_group("engine settings (EngineConfig fields; defaults as LLM())")
    for f in EngineConfig.flat_fields():
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
        group.add_argument("--" + f.name.replace("_", "-"), dest="engine." + f.name, metavar=f.name.upper(),
                           type=_converter(f.name, annotation), default=argparse.SUPPRESS,
                           help=f"{annotation}, default {f.default!r}")


def engine_settings(args: argparse.Namespace) -> dict:
    """The engine settings given on the command line; ``ValueError`` (naming the field) if
    ``EngineConfig`` refuses them."""
    settings = {k.split(".", 1)[1]: v for k, v in vars(args).items() if k.startswith("engine.")}
    EngineConfig(**settings)  # validates (and raises) before any model loads
    return settings
