"""One router per resource of the REST API v1."""
