"""``python -m hf_evon.cli``: the ``hf-evon`` command."""

import sys

from hf_evon.cli.commands import main

sys.exit(main())
