"""``python -m hf_evon``: the ``hf-evon`` command, as ``python -m hf_evon.cli``."""

import sys

from hf_evon.cli.commands import main

sys.exit(main())
