"""SWE-style tasks built offline from real packages: ``raas swe build`` (see docs/swe-records.md)."""
