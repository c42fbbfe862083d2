-- psql's cancel, run by psql_client.sh: SIGINT while pg_sleep runs (psql sends
-- a CancelRequest), and the script stops there.
\set VERBOSITY verbose
SELECT pg_backend_pid() AS pid \gset
\setenv SLEEPER :pid
\! sh "$PSQL_CLIENT" cancel-when-running $PPID &
SELECT pg_sleep(60);
