-- Tokens are managed by name (POST/DELETE /v1/tokens), so a name means one token.
CREATE UNIQUE INDEX tokens_name ON tokens (name);
