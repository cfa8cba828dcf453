"""The mutation campaign: realistic one-line bugs planted in a scratch copy of the tree,
each run against the CPU suite (``catalogue.py`` lists them, ``run.py`` runs them).
Not collected by pytest (no ``test_*`` names) and not run in CI: a campaign takes hours."""
