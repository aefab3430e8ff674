"""``swe-mini``: a bug-fix curriculum a small policy can climb, served through the SWE handler."""
