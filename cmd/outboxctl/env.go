package main

import (
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
// flags win over the environment, the environment over the defaults. A
// value that does not parse is a usage error naming the variable, never
// quoting the value (it may be a secret, e.g. OUTBOX_AMQP_URL).
func bindEnv(cmd *cobra.Command, getenv func(string) string) error {
	var err error
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if err != nil || f.Changed || f.Name == "help" {
			return
		}
		v, ok := lookup(getenv, envName(f.Name))
		if !ok {
			return
		}
		if serr := f.Value.Set(v); serr != nil {
			err = outbox.Errorf(CodeUsage, "outboxctl "+cmd.Name(), "%s is not a valid value for --%s (%s)", envName(f.Name), f.Name, f.Value.Type())
		}
	})
	return err
}

// lookup reads an environment variable through getenv; an empty value
// counts as unset, as for OUTBOX_DATABASE_URL.
func lookup(getenv func(string) string, name string) (string, bool) {
	v := getenv(name)
	return v, v != ""
}
