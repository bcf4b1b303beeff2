package relaymode

// SQLBeat lets the race tests hold Beat's real statement open in a
// transaction instead of a hand-written copy of it.
const SQLBeat = sqlBeat
