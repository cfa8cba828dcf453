"""The test suite, a package so that every test module has a unique name (``tests.core.test_runtime``)
and every test imports the shared helpers one way: ``from tests.support.<module> import ...``."""
