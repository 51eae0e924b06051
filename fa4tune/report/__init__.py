"""`fa4tune report`: the searches, the database and the bench read into plain data, then drawn as one HTML file."""
