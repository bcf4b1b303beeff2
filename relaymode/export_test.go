package relaymode

// SQLBeat lets the race tests hold Beat's real statement open in a
// transaction instead of a hand-written copy of it.
const SQLBeat = sqlBeat

// RestoreModeSQL is the INSERT RELAY_MODE_MISSING's detail tells operators
// to run; a test holds it equal to the migration's.
const RestoreModeSQL = restoreModeSQL
