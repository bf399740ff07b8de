-- The one scheduler among server replicas. The replica holding this lease places jobs and renews
-- it inside every scheduling pass's transaction, so a pass commits only while its replica holds
-- it; `term` rises whenever another replica takes it over, so a holder knows when someone
-- else may have placed jobs since its last pass. Node registration and lost-node reaping raise
-- `nodes_version`, so the scheduler re-reads the devices only when they change.
CREATE TABLE scheduling (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    holder        TEXT    NOT NULL,
    expires_at    BIGINT  NOT NULL,
    term          BIGINT  NOT NULL,
    nodes_version BIGINT  NOT NULL
);
INSERT INTO scheduling (id, holder, expires_at, term, nodes_version) VALUES (1, '', 0, 0, 0);
