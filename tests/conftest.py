"""Fixtures shared by every test directory."""

# The GCS emulator fixture (`gcs_bucket`) lives in tests/gcs_emulator.py; registering it
# here makes it one server per session instead of one per importing module.
pytest_plugins = ["gcs_emulator"]
