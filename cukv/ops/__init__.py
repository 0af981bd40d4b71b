"""One module per kernel family: validate -> plan -> launch."""
