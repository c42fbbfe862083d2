package sqltx

// ReferenceSplit exposes the slow, obvious implementation of Split to the
// external tests, which compare the two.
var ReferenceSplit = referenceSplit

// SafeEncodingNames exposes the aliases ClientEncodingSafe accepts, for the
// test that checks each one against the server.
var SafeEncodingNames = safeEncodingNames
