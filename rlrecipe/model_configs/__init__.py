"""config.json of the hub models the recipes name, for `rlrecipe plan` without a download (data only)."""
