"""The checkout verbs' machinery: a user's vLLM checkout opened under its repository's
lock, the plan of what the series is there, and applying or reverting it all or nothing."""
