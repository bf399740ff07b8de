-- The mean validation loss of a step after which validation ran; NULL on the other steps (and
-- for NaN, as the other real columns).
ALTER TABLE steps ADD COLUMN validation_loss DOUBLE PRECISION;
