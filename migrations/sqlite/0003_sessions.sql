-- Console sessions (POST /v1/session): a browser exchanged a bearer token for a cookie. Only
-- the cookie's SHA-256 is kept, bound to the token it came from: revoking the token deletes its
-- sessions, and every lookup joins `tokens`, so a revoked token's cookie stops at once.
CREATE TABLE sessions (
    hash       TEXT    PRIMARY KEY,
    token_hash TEXT    NOT NULL REFERENCES tokens (hash) ON DELETE CASCADE,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
);
CREATE INDEX sessions_token ON sessions (token_hash);
CREATE INDEX sessions_expiry ON sessions (expires_at);
