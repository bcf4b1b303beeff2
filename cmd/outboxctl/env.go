package main

import (
	"errors"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// envName is the environment variable that sets the flag name:
// OUTBOX_ + the name upper-cased with '-' as '_' (--max-attempts is
// OUTBOX_MAX_ATTEMPTS, --database-url is OUTBOX_DATABASE_URL).
func envName(flag string) string {
	return "OUTBOX_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// envFlags names, in each flag's help, the variable that sets it. Call it
// once the command's flags are registered.
func envFlags(cmd *cobra.Command) {
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if f.Name == "help" {
			return
		}
		f.Usage += " [$" + envName(f.Name) + "]"
	})
}

// bindEnv sets every flag of cmd's own flag set that was not given on the
// command line from its environment variable (envName), when that is set:
// flags win over the environment, the environment over the defaults. Each
// variable may instead name a file holding the value: OUTBOX_X_FILE. A
// value that does not parse is a usage error naming the variable, never
// quoting the value (it may be a secret, e.g. OUTBOX_AMQP_URL).
func bindEnv(cmd *cobra.Command, getenv func(string) string) error {
	var err error
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if err != nil || f.Changed || f.Name == "help" {
			return
		}
		v, ok, ferr := lookupFile(getenv, envName(f.Name))
		if ferr != nil {
			err = ferr
			return
		}
		if !ok {
			return
		}
		if serr := f.Value.Set(v); serr != nil {
			err = outbox.Errorf(CodeUsage, "outboxctl "+cmd.Name(), "%s is not a valid value for --%s (%s)", envName(f.Name), f.Name, f.Value.Type())
		}
	})
	return err
}

// lookupFile reads the variable name through getenv or, when it is unset
// or empty, the file that name+"_FILE" names (a mounted Kubernetes secret, a
// systemd credential), without its final line break. An empty value counts
// as unset. A file that cannot be read is a usage error naming the variable
// and the path, never the content.
func lookupFile(getenv func(string) string, name string) (string, bool, error) {
	if v := getenv(name); v != "" {
		return v, true, nil
	}
	path := getenv(name + "_FILE")
	if path == "" {
		return "", false, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", false, outbox.Errorf(CodeUsage, "outboxctl", "%s_FILE names %s, which cannot be read: %v", name, path, errors.Unwrap(err))
	}
	v := strings.TrimRight(string(b), "\r\n")
	return v, v != "", nil
}
