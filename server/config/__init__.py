"""The deployment's configuration: one declared schema with the rules that span a deployment's
servers (`schema`), and the YAML reading with errors that name the file and the key (`yaml_io`)."""
