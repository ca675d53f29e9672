"""``python -m gradgen.bench``: the same as ``gradgen bench``."""

from gradgen.bench import main

raise SystemExit(main())
