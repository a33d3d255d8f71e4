// The command line of sparseps's programs (the daemons, sparseps-eval, sparseps-keygen, the test
// helpers), parsed by CLI11 behind this class: CLI11's header costs about 10 s of compiling in
// each translation unit that includes it, so only command_line.cc does.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace CLI {
class App;
}  // namespace CLI

namespace sparseps {

// A program's options, help (--help, -h) and --version, declared before Parse. Each option
// writes into the variable it was given when Parse sees it; the variable keeps its value
// otherwise.
//
// Thread-safety: one thread; the variables must outlive Parse.
class CommandLine {
 public:
  // What an option must satisfy; they combine with |.
  enum Check : unsigned {
    kOptional = 0,
    kRequired = 1,      // the command line must give it
    kExistingFile = 2,  // its value must name a file that exists
  };

  // `description` heads --help; `name` is the program's name in it.
  CommandLine(const std::string& description, const std::string& name);
  ~CommandLine();
  CommandLine(const CommandLine&) = delete;
  CommandLine& operator=(const CommandLine&) = delete;

  // Text printed after the options in --help.
  void Footer(const std::string& text);
  // --version prints `text` and ends the program with exit code 0.
  void Version(const std::string& text);

  // An option with one value. `names`: CLI11's syntax, "-c,--config", or "DIR" for a positional.
  void Option(const std::string& names, std::string* value, const std::string& help = "",
              unsigned checks = kOptional);
  void Option(const std::string& names, int64_t* value, const std::string& help = "",
              unsigned checks = kOptional);
  // An option that may repeat and take several values (--set a=1 b=2 --set c=3): every value, in
  // order, appended to `values`.
  void Option(const std::string& names, std::vector<std::string>* values,
              const std::string& help = "", unsigned checks = kOptional);
  // A flag without a value: true when given.
  void Flag(const std::string& names, bool* value, const std::string& help = "");

  // Parses argv. Returns -1 when the program should go on; otherwise the exit code to end it with:
  // 0 after --help or --version (printed to stdout), 2 for a bad command line (the error and a
  // hint to --help on stderr).
  int Parse(int argc, const char* const* argv);

 private:
  std::unique_ptr<CLI::App> app_;
};

}  // namespace sparseps
