"""The ``hf-evon`` command line: ``generate``, ``inspect``, ``calibrate`` (:mod:`hf_evon.cli.commands`);
what they load and from where: :mod:`hf_evon.cli.loading`; what ``--output`` may hold: :mod:`hf_evon.cli.output`."""

from hf_evon.cli.commands import SUBCOMMANDS, build_parser, main

__all__ = ["SUBCOMMANDS", "build_parser", "main"]
