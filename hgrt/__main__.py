"""``python -m hgrt ...`` runs the ``hgrt`` command line."""

import sys

from hgrt.cli import main

sys.exit(main())
