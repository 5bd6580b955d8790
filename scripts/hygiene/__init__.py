"""Rules behind scripts/check_hygiene.py; each module holds one family of rules."""
