"""What several test modules share: builders of tables, stores and processes, one module
per topic. Test modules import from here (or take a fixture of tests/conftest.py), never
from another test module (tests/test_tests.py)."""
