"""The web dashboard at /ui (static HTML, CSS and vanilla JS that call the REST API with the key the
person signs in with) and the offline API page at /docs."""
