package main

import "errors"

func asExit(err error, target *interface{ ExitCode() int }) bool {
	return errors.As(err, target)
}
